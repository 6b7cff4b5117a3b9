"""A preloaded launcher for the test suite's Python processes: each starts in a few milliseconds instead of the
seconds that importing torch and Lightning takes, and behaves as a fresh interpreter would.

The server (`python tests/tools/zygote.py SOCKET`) imports torch, Lightning and gpt_tp once, then serves requests on a
Unix socket. A request is what a fresh process would start from: argv, environment, working directory, umask,
process group, signal dispositions and mask, CPU affinity and the open file descriptors (passed with SCM_RIGHTS).
For each it forks; the child takes on that state and runs the script, `-m` module or `-c` code as __main__.

The client (write_client: an executable whose shebang is the real interpreter with -S) forwards its argv, environment,
working directory and file descriptors, forwards SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2 and SIGQUIT to the child,
and exits as the child did (killed by signal N: it kills itself with N). A client in another session than the
server's gets a child that leads a session of its own, and forwards signals to the child's process group: a signal
sent to the client's group reaches every process of the child's group, one sent to the client alone does too, and
`ps --ppid`/`pgrep -s` on the client find none of them (a test that looks there is marked real_interpreter). The
server kills the child when the client dies and stops/continues it with the client. Anything the zygote cannot
reproduce exactly runs the real interpreter instead (os.execv): an unknown interpreter flag, an environment variable
read at interpreter or library start that differs from the server's (but for OMP_NUM_THREADS unset: the child takes
torch's default thread count), a path entry that would shadow a preloaded module or holds a sitecustomize,
GPT_TP_NO_ZYGOTE=1, or no server.

    python tests/tools/zygote.py /tmp/z.sock &       # the server
    python tests/tools/zygote.py --client /tmp/z.sock /tmp/python   # writes the client
    /tmp/python cli.py fit ...                        # as `python cli.py fit ...`
"""

import json
import os
import signal
import socket
import struct
import sys

FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT")
# environment read when the interpreter, the C runtime or a native library starts (beside what the preloaded Python
# modules read on import, which the server records): a client whose value differs from the server's runs the real
# interpreter. HANDLED_ENV: what the child sets up from the client's values.
STARTUP_ENV = ("LD_", "MALLOC_", "GLIBC_", "PYTHON", "LC_", "LANG", "TORCH", "PYTORCH", "KMP_", "MKL_", "OMP_", "GOMP_",
               "OPENBLAS_", "CUDA", "NCCL_", "TQDM_", "FSSPEC_")
HANDLED_ENV = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "TORCHELASTIC_", "TORCH_NCCL_",
               "TMPDIR", "TEMP", "TMP")
# read during the imports by calls whose result nothing keeps: argparse's help width, torch.testing's skip conditions
CALL_TIME_ENV = ("COLUMNS", "LINES", "PYTEST_CURRENT_TEST")
RANK_ENV = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")  # Lightning's rank_zero_only.rank on import
FLAGS = {"u": "unbuffered", "B": "dont_write_bytecode", "s": "no_user_site", "E": "ignore_environment"}


# ---- wire format: 4-byte length + JSON, file descriptors alongside the first message ---------------------------------
def send(sock, obj, fds=()):
    data = json.dumps(obj).encode()
    socket.send_fds(sock, [struct.pack("!I", len(data)) + data], list(fds))


def recv(sock, maxfds=0):
    head, fds, _, _ = socket.recv_fds(sock, 4, maxfds) if maxfds else (sock.recv(4), [], 0, None)
    if len(head) < 4:
        for fd in fds:
            os.close(fd)
        return None, []
    (n,), data = struct.unpack("!I", head), b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data), fds


# ---- client ------------------------------------------------------------------------------------------------------------
def parse_flags(args):
    """The interpreter's flags in args -> ({flag names}, [-W options], [-X options], (kind, target, rest)) where kind is
    'script', 'module' or 'code'; None where the zygote does not reproduce them."""
    flags, warn, xopts, i = set(), [], [], 0
    while i < len(args):
        a = args[i]
        if a == "--" or not a.startswith("-") or a == "-":
            break
        j = 1
        while j < len(a):
            c = a[j]
            if c in FLAGS:
                flags.add(FLAGS[c])
                j += 1
                continue
            if c not in "mcWX":
                return None
            value = a[j + 1:] or (args[i + 1] if i + 1 < len(args) else None)
            if value is None:
                return None
            i += 1 if a[j + 1:] else 2
            if c == "m":
                return flags, warn, xopts, ("module", value, args[i:])
            if c == "c":
                return flags, warn, xopts, ("code", value, args[i:])
            (warn if c == "W" else xopts).append(value)
            break
        else:
            i += 1
    if i < len(args) and args[i] == "--":
        i += 1
    if i >= len(args) or args[i] == "-":
        return None  # interactive or a script on stdin
    return flags, warn, xopts, ("script", args[i], args[i + 1:])


def client(sock_path, real, server_sid):
    """Run sys.argv[1:] as `real` would, in the zygote where it can; this process stands for the child."""
    args = sys.argv[1:]
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])

    def real_python(why):
        if os.environ.get("GPT_TP_ZYGOTE_LOG"):
            with open(os.environ["GPT_TP_ZYGOTE_LOG"], "a") as f:
                f.write(f"{os.getpid()} real ({why}): {args[:3]}\n")
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.execv(real, [real, *args])

    if os.environ.get("GPT_TP_NO_ZYGOTE") == "1":
        real_python("GPT_TP_NO_ZYGOTE=1")
    parsed = parse_flags(args)
    if parsed is None:
        real_python("flags")
    # a client in another session than the server's (started with start_new_session, by torchrun or by Slurm, or a
    # child of such a client's child): the child cannot join that session's process group, so it leads a session of
    # its own, and the client's signals go to the child's process group, where the child's own clients get them
    session = os.getsid(0) != server_sid
    forwarded = [getattr(signal, s) for s in FORWARDED]
    # a signal that arrives before the child's pid is known waits, then goes to the child
    signal.pthread_sigmask(signal.SIG_BLOCK, forwarded)
    fds = sorted(_open_fds())
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(sock_path)
    except OSError:
        real_python("no server")
    umask = os.umask(0)
    os.umask(umask)
    ignored = [int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
               and signal.getsignal(s) == signal.SIG_IGN]
    request = {"args": args, "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask, "pgid": os.getpgid(0),
               "client": os.getpid(), "executable": sys.argv[0], "ignored": ignored, "mask": [int(s) for s in mask],
               "affinity": sorted(os.sched_getaffinity(0)), "fds": fds, "session": session}
    send(sock, request, fds)
    reply, _ = recv(sock)
    if reply is None or "fallback" in reply:
        sock.close()
        real_python(reply["fallback"] if reply else "server closed")
    child = reply["pid"]
    kill = os.killpg if session else os.kill

    def forward(signum, frame):
        try:
            kill(child, signum)
        except OSError:  # the child has ended: its status is on its way
            pass

    for s in forwarded:
        signal.signal(s, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    while True:
        try:
            reply, _ = recv(sock)
            break
        except InterruptedError:
            continue
    if reply is None:  # the server died: the child's status is unknown
        os._exit(255)
    if reply["signal"]:
        if reply["signal"] not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(reply["signal"], signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [reply["signal"]])
        os.kill(os.getpid(), reply["signal"])
    os._exit(reply["code"])


def _open_fds():
    return {fd for fd in map(int, os.listdir("/proc/self/fd")) if _is_open(fd)}


def _is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def write_client(sock_path, path, real=sys.executable):
    """An executable file at `path` that runs as `real` does, through the server on sock_path."""
    tools = os.path.dirname(os.path.abspath(__file__))
    with open(path, "w") as f:
        f.write(f"#!{real} -S\nimport sys\nsys.path.insert(0, {tools!r})\nfrom zygote import client\n"
                f"client({sock_path!r}, {real!r}, {os.getsid(0)})\n")
    os.chmod(path, 0o755)
    return path


# ---- server ------------------------------------------------------------------------------------------------------------
class Server:
    def __init__(self, sock_path):
        import subprocess
        import warnings

        self.start_env = dict(os.environ)
        # torch's thread count in a fresh process without OMP_NUM_THREADS, measured beside the imports: a client without
        # the variable is served, its child setting that count (threads_of)
        unset = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        probe = subprocess.Popen([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=unset,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.start_affinity = sorted(os.sched_getaffinity(0))
        inherited = _open_fds()
        pythonpath = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.base_path = [p for p in sys.path[1:] if p not in pythonpath]
        self.start_filters = list(warnings.filters)
        # listening before the imports: a client that comes early waits for them instead of starting the real interpreter
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(sock_path)
        self.sock.listen(256)
        self.preload()
        out = probe.communicate()[0].strip()
        self.default_threads = int(out) if probe.returncode == 0 and out.isdigit() else None
        import gc

        gc.collect()
        gc.freeze()  # the preloaded objects out of the children's collections: their pages stay shared
        self.import_filters = warnings.filters[:len(warnings.filters) - len(self.start_filters)]
        self.modules = {n: m.__file__ for n, m in list(sys.modules.items()) if "." not in n and getattr(m, "__file__", None)}
        self.library_fds = _open_fds() - inherited - {self.sock.fileno()}  # the preloaded modules': a fresh process has them too
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.running = {}  # child pid -> [connection, client pid, stopped]
        self.conns = {}  # connection fd -> child pid

    def preload(self):
        """Import what the suite's processes use, recording the environment variables read meanwhile by name, not
        those only a scan of the whole environment read (fsspec's `dict(os.environ)` looking for FSSPEC_*, tqdm's
        for TQDM_*: prefixes in STARTUP_ENV). A scan reads every variable once, so a variable read no more often than
        the least read one was read by the scans alone."""
        environ, reads, present = os.environ, {}, set(os.environ)  # a variable set during the imports misses scans

        class Recording(type(os.environ)):
            def __getitem__(env, key):
                reads[key] = reads.get(key, 0) + 1
                return super().__getitem__(key)

            def __contains__(env, key):
                reads[key] = reads.get(key, 0) + 1
                return super().__contains__(key)

        os.environ = Recording(environ._data, environ.encodekey, environ.decodekey, environ.encodevalue, environ.decodevalue)
        try:
            self.import_modules()
        finally:
            os.environ = environ
        scans = min((reads.get(k, 0) for k in present), default=0)
        self.read_env = {k for k, n in reads.items() if k not in present or n > scans}

    def import_modules(self):
        import importlib
        import pkgutil
        import warnings

        with warnings.catch_warnings(record=True) as shown:
            import lightning.pytorch  # noqa: F401
            import numpy  # noqa: F401
            import torch  # noqa: F401
            import torch.distributed.run  # noqa: F401

            import gpt_tp

            for m in pkgutil.walk_packages(gpt_tp.__path__, "gpt_tp."):
                importlib.import_module(m.name)
        self.preload_warnings = [str(w.message) for w in shown]

    def single_threaded(self):
        import threading

        return threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1

    def serve(self):
        """Serve until the socket is removed; returns the request in a forked child."""
        import select

        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *a: None)
        while os.path.exists(self.sock.getsockname()):
            ready, _, _ = select.select([self.sock, self.wake_r, *self.conns], [], [], 0.05 if self.running else 1)
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
            if self.sock in ready:
                conn, _ = self.sock.accept()
                request = self.accept(conn)
                if request is not None:
                    return request
            for fd in [fd for fd in ready if isinstance(fd, int) and fd in self.conns]:
                self.client_gone(fd)
            self.reap()
            self.mirror_stops()
        return None

    def accept(self, conn):
        try:
            request, fds = recv(conn, maxfds=250)
        except OSError:
            request, fds = None, []
        if request is None:
            conn.close()
            return None
        why = self.cannot_serve(request, fds)
        if why:
            for fd in fds:
                os.close(fd)
            send(conn, {"fallback": why})
            conn.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            request["received"] = fds
            signal.set_wakeup_fd(-1)
            for s in (self.sock, conn, *(entry[0] for entry in self.running.values() if entry[0] is not None)):
                s.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            return request
        for fd in fds:
            os.close(fd)
        send(conn, {"pid": pid})
        self.running[pid] = [conn, request["client"], False, os.killpg if request["session"] else os.kill]
        self.conns[conn.fileno()] = pid
        return None

    def cannot_serve(self, request, fds):
        parsed = parse_flags(request["args"])
        if parsed is None:
            return "flags"
        if not self.single_threaded():
            return "the server has threads: it must not fork"
        if len(fds) != len(request["fds"]):
            return "file descriptors lost"
        if set(request["fds"]) & self.library_fds:
            return "a file descriptor number the server uses"
        if parsed[2]:
            return "-X option"
        env, ignore_env = request["env"], "ignore_environment" in parsed[0]
        for k in set(env) | set(self.start_env):
            if env.get(k) == self.start_env.get(k) or k.startswith(HANDLED_ENV) or k in RANK_ENV + CALL_TIME_ENV:
                continue
            if k == "OMP_NUM_THREADS" and self.threads_of(request) is not None:
                continue
            if (k.startswith(STARTUP_ENV) and not (ignore_env and k.startswith("PYTHON"))) or k in self.read_env:
                return f"{k} differs from the server's"
        for d in child_path(request, parsed):
            try:
                names = os.listdir(d or request["cwd"])
            except OSError:
                continue
            for name in names:
                top = name[:-3] if name.endswith(".py") else name.partition(".")[0]
                if top in ("sitecustomize", "usercustomize") and top not in self.modules:
                    return f"{os.path.join(d or request['cwd'], name)} runs at start"  # site imports it
                file = self.modules.get(top)
                if not file:
                    continue
                p = os.path.join(d or request["cwd"], name)
                p = os.path.join(p, "__init__.py") if os.path.isdir(p) else p
                if os.path.exists(p) and os.path.realpath(p) != os.path.realpath(file):
                    return f"{p} shadows the preloaded {top}"
        return None

    def threads_of(self, request):
        """torch's intra-op thread count in a fresh process the client starts without OMP_NUM_THREADS: the count
        measured at start, on the server's CPUs only (torch derives it from the cores and caps a set value by them,
        so another value is not mirrored); None where it is not known."""
        if "OMP_NUM_THREADS" in request["env"] or request["affinity"] != self.start_affinity:
            return None
        return self.default_threads

    def client_gone(self, fd):
        """A client closed its connection (it died): its child dies the same way."""
        pid = self.conns.pop(fd)
        conn = self.running[pid][0]
        self.running[pid][0] = None
        conn.close()
        try:
            self.running[pid][3](pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def reap(self):
        for pid in list(self.running):
            try:
                done, status, usage = os.wait4(pid, os.WNOHANG)
            except ChildProcessError:
                done, status, usage = pid, 255 << 8, None
            if not done:
                continue
            conn = self.running.pop(pid)[0]
            if usage:
                print(f"{pid} cpu {usage.ru_utime + usage.ru_stime:.2f} s status {status}", flush=True)
            if conn is None:
                continue
            self.conns.pop(conn.fileno(), None)
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            try:
                send(conn, {"signal": sig, "code": os.WEXITSTATUS(status) if not sig else 0})
            except OSError:
                pass
            conn.close()

    def mirror_stops(self):
        """A stopped client (SIGSTOP cannot be caught and forwarded) stops its child; continued, continues it."""
        for pid, entry in self.running.items():
            try:
                with open(f"/proc/{entry[1]}/stat") as f:
                    stopped = f.read().rpartition(")")[2].split()[0] in "tT"
            except OSError:
                continue
            if stopped != entry[2]:
                entry[2] = stopped
                try:
                    entry[3](pid, signal.SIGSTOP if stopped else signal.SIGCONT)
                except ProcessLookupError:
                    pass


def child_path(request, parsed):
    """sys.path as a fresh interpreter started by the client would have it, less the standard entries."""
    flags, _, _, (kind, target, _) = parsed
    cwd, env = request["cwd"], request["env"]
    first = {"script": os.path.dirname(os.path.realpath(os.path.join(cwd, target))), "module": cwd, "code": ""}[kind]
    extra = [] if "ignore_environment" in flags else env.get("PYTHONPATH", "").split(os.pathsep)
    path = [first]
    for p in extra:
        p = os.path.abspath(os.path.join(cwd, p)) if p else None
        if p and p not in path:
            path.append(p)
    return path


def become(server, request):
    """In the forked child: take on the client's process state, then run its program as __main__."""
    import tempfile
    import warnings

    parsed = parse_flags(request["args"])
    flags, warnopts, xopts, (kind, target, rest) = parsed
    env = request["env"]
    if request["session"]:
        os.setsid()
    else:
        os.setpgid(0, request["pgid"])
    # file descriptors: the client's, at the same numbers; none of the server's connections
    moved = [os.dup(fd) for fd in request["received"]]
    for fd in request["received"]:
        os.close(fd)
    for src, dst in zip(moved, request["fds"]):
        os.dup2(src, dst)
    for fd in moved:
        if fd not in request["fds"]:
            os.close(fd)
    for fd in _open_fds() - server.library_fds - set(request["fds"]):
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.sched_setaffinity(0, request["affinity"])
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None
    # signals as a fresh interpreter sets them: inherited ignores kept, Python's own SIGINT/SIGPIPE/SIGXFSZ handling
    for s in signal.valid_signals():
        if s in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(s, signal.SIG_IGN if s in request["ignored"] else signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    for s in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(s, signal.SIG_IGN)
    if signal.SIGINT not in request["ignored"]:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["mask"])
    use_env = "ignore_environment" not in flags
    unbuffered = "unbuffered" in flags or (use_env and bool(env.get("PYTHONUNBUFFERED")))
    sys.dont_write_bytecode = "dont_write_bytecode" in flags or (use_env and bool(env.get("PYTHONDONTWRITEBYTECODE")))
    sys.stdin, sys.stdout, sys.stderr = (_stdio(fd, like, unbuffered) if fd in request["fds"] else None
                                         for fd, like in enumerate((sys.__stdin__, sys.__stdout__, sys.__stderr__)))
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.warnoptions[:] = [*(env.get("PYTHONWARNINGS", "").split(",") if use_env and env.get("PYTHONWARNINGS") else []),
                          *warnopts]
    if sys.warnoptions:
        warnings.filters[:] = server.start_filters
        warnings._processoptions(sys.warnoptions)
        warnings.filters[:0] = server.import_filters
        warnings._filters_mutated()
    import torch

    threads = server.threads_of(request)
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)  # as torch sets it at start without OMP_NUM_THREADS (the server's is 1)
    from lightning_utilities.core.rank_zero import rank_zero_only

    # as lightning.fabric.utilities.rank_zero sets it on import
    rank_zero_only.rank = next((int(env[k]) for k in RANK_ENV if k in env), 0)
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()  # a fresh process seeds numpy's global generator from the OS
    first = child_path(request, parsed)
    sys.path[:] = first + [p for p in server.base_path if p not in first[1:]]
    sys.executable = request["executable"]
    sys.orig_argv[:] = [request["executable"], *request["args"]]
    run_main(kind, target, rest, request["cwd"])


def _stdio(fd, like, unbuffered):
    """sys.stdin/stdout/stderr as CPython makes them (Python/pylifecycle.c create_stdio)."""
    import io

    write = fd != 0
    buffering = 0 if unbuffered and write else -1
    buf = io.open(fd, "wb" if write else "rb", buffering, closefd=False)
    raw = buf if buffering == 0 else buf.raw
    line = not unbuffered and (raw.isatty() or fd == 2)
    stream = io.TextIOWrapper(buf, like.encoding, like.errors, "\n", line, unbuffered)
    stream.mode = "w" if write else "r"
    return stream


def run_main(kind, target, rest, cwd):
    import runpy
    import traceback
    import types

    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    try:
        if kind == "module":
            sys.argv[:] = ["-m", *rest]
            # preloaded here, but a fresh interpreter imports the target only as __main__ (else runpy warns)
            sys.modules.pop(target, None)
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv[:] = ["-c" if kind == "code" else target, *rest]
            if kind == "code":
                source, filename = target, "<string>"
            else:
                filename = os.path.join(cwd, target) if not os.path.isabs(target) else target
                try:
                    with open(filename, "rb") as f:
                        source = f.read()
                except OSError as e:
                    print(f"{sys.orig_argv[0]}: can't open file {filename!r}: [Errno {e.errno}] {e.strerror}",
                          file=sys.stderr)
                    sys.exit(2)
                from importlib.machinery import SourceFileLoader

                main.__file__, main.__cached__ = filename, None
                main.__loader__ = SourceFileLoader("__main__", filename)
            main.__spec__, main.__package__ = None, None
            exec(compile(source, filename, "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        if isinstance(e, KeyboardInterrupt):  # Python ends with SIGINT's default action after an uncaught Ctrl-C
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)


def server_main(sock_path):
    server = Server(sock_path)
    if not server.single_threaded():
        print(f"zygote: the preloaded modules started threads: not serving", file=sys.stderr)
        os.unlink(sock_path)
        return
    request = server.serve()
    if request is not None:
        become(server, request)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        write_client(sys.argv[2], sys.argv[3])
    else:
        server_main(sys.argv[1])
