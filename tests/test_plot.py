"""The plot command: a PNG from a small CSVLogger log, clear errors on a missing or empty one, NaN-safe titles, and
a resumed run (written by Lightning's own CSVLogger, with RunLineage) joined with the runs it continues."""

import subprocess
import sys

import pytest

from conftest import ROOT, one_error_line
from gpt_tp.train.plot import PlotError, find_csv, join, main, plot, read_metrics, run_csvs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# the shape of a Lightning CSVLogger file: one row per log call, blank cells elsewhere
CSV = """epoch,hellaswag/acc,hellaswag/acc_norm,step,train/grad_norm,train/loss,train/lr,val/loss
0,,,0,1.7,10.9,0.0015,
0,,,1,1.4,9.8,0.003,
0,,,1,,,,9.5
,0.25,0.26,2,,,,
0,,,2,1.1,8.7,0.003,
0,,,3,1.0,7.9,0.0016,
0,,,3,,,,7.6
,0.27,0.29,4,,,,
"""


def write_run(tmp_path, text=CSV):
    run = tmp_path / "logs" / "gpt_tp" / "version_0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text(text)
    return run


def test_read_metrics(tmp_path):
    m = read_metrics(write_run(tmp_path) / "metrics.csv")
    assert m["train/loss"] == [(0, 10.9), (1, 9.8), (2, 8.7), (3, 7.9)]
    assert m["val/loss"] == [(1, 9.5), (3, 7.6)]
    assert m["hellaswag/acc_norm"] == [(2, 0.26), (4, 0.29)]


@pytest.mark.parametrize("target", ["run", "csv", "logs"])
def test_writes_png(tmp_path, target):
    run = write_run(tmp_path)
    arg = {"run": run, "csv": run / "metrics.csv", "logs": tmp_path / "logs"}[target]
    out = main([str(arg), "-o", str(tmp_path / "out" / "run.png")])
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
    assert int.from_bytes(data[16:20], "big") == 1600 and int.from_bytes(data[20:24], "big") == 600  # IHDR size


def test_loss_only_log_still_plots(tmp_path):
    run = write_run(tmp_path, "step,train/loss\n0,10.0\n1,9.0\n")
    out = main([str(run), "-o", str(tmp_path / "a.png"), "--no-reference"])
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_missing_or_empty_csv_fails_clearly(tmp_path):
    with pytest.raises(PlotError, match="not found: pass a CSVLogger run dir"):
        find_csv(tmp_path / "nope")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(PlotError, match="no metrics.csv under"):
        find_csv(tmp_path / "empty_dir")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(PlotError, match="is empty"):
        read_metrics(tmp_path / "empty.csv")
    (tmp_path / "header.csv").write_text("epoch,step,train/loss\n")
    with pytest.raises(PlotError, match="holds no values"):
        read_metrics(tmp_path / "header.csv")
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(PlotError, match="no 'step' column"):
        read_metrics(tmp_path / "other.csv")
    (tmp_path / "bad.csv").write_text("step,train/loss\n0,abc\n")
    with pytest.raises(PlotError, match=r"bad.csv:2: cannot read"):
        read_metrics(tmp_path / "bad.csv")
    # the command: one line, exit status 2, nothing written
    proc = subprocess.run([sys.executable, "-m", "gpt_tp.train.plot", str(tmp_path / "empty.csv"), "-o", str(tmp_path / "x.png")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [f"error: {tmp_path / 'empty.csv'} is empty: no header "
                                                                  "row (has the run logged a step yet?)"]
    assert not (tmp_path / "x.png").exists()


def _titles(monkeypatch, metrics, tmp_path) -> list[str]:
    """The left-hand titles plot() sets, read back from matplotlib's axes."""
    import matplotlib.pyplot as plt

    seen = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (seen.extend(ax.get_title("left") for ax in fig.axes), close(fig)))
    plot(metrics, tmp_path / "t.png")
    return seen


def test_nan_values(tmp_path, monkeypatch):
    """min() of (nan, 7.5, 9.0) is nan in Python; the title takes the finite values. An all-NaN log is an error."""
    run = write_run(tmp_path, "step,train/loss,val/loss\n0,10.0,nan\n1,9.0,7.5\n2,nan,9.0\n")
    m = read_metrics(run / "metrics.csv")
    assert m["val/loss"][0][1] != m["val/loss"][0][1] and str(min(v for _, v in m["val/loss"])) == "nan"
    assert _titles(monkeypatch, m, tmp_path) == ["min val loss: 7.5000", "no hellaswag/acc_norm logged"]
    bad = tmp_path / "nan.csv"
    bad.write_text("step,train/loss,val/loss\n0,nan,\n1,nan,nan\n")
    with pytest.raises(PlotError, match="every logged value of train/loss, val/loss is NaN or infinite"):
        main([str(bad), "-o", str(tmp_path / "nan.png")])
    assert not (tmp_path / "nan.png").exists()


def test_help_names_the_default_output(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "run.png in the current directory" in " ".join(capsys.readouterr().out.split())


def test_bad_flag_is_one_error_line(tmp_path, command_here):
    """In this process as its __main__ runs it (test_missing_or_empty_csv_fails_clearly runs `python -m`)."""
    proc = command_here(lambda: main([str(tmp_path), "--no-such-flag"]))
    assert one_error_line(proc) == "error: unrecognized arguments: --no-such-flag (see python -m gpt_tp.train.plot --help)"


def _fit(logs, ckpts, max_steps, ckpt_path=None, shift=0.0, lr=0.1):
    """A real Lightning run on CPU with the CSVLogger and RunLineage (as cli.py adds it): logs train/loss every step
    and val/loss every 3 steps, checkpoints every 3 steps. `shift` is added to what it logs to tell versions apart."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from gpt_tp.train.logs import RunLineage

    class Model(L.LightningModule):
        def __init__(self, lr):
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            loss = ((self.layer(batch[0]) - batch[1]) ** 2).mean()
            self.log("train/loss", loss + shift)
            return loss

        def validation_step(self, batch, _):
            self.log("val/loss", ((self.layer(batch[0]) - batch[1]) ** 2).mean() + shift)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=CSVLogger(logs, name="gpt_tp"), log_every_n_steps=1,
        val_check_interval=3, limit_val_batches=1, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=ckpts, every_n_train_steps=3, save_top_k=-1, filename="s{step}"),
                   RunLineage()])
    trainer.fit(Model(lr), data, data, ckpt_path=ckpt_path)


def test_a_run_is_drawn_with_its_ancestors_by_checkpoint(tmp_path, capsys):
    """Versions join only where one resumed from a checkpoint another saved (lineage.json): siblings resumed from the
    same checkpoint, a fresh run with the same hyper-parameters and a log without lineage.json stay apart."""
    logs, ck = tmp_path / "logs", tmp_path / "ck"
    _fit(logs, ck, 6)  # version_0: steps 0..5, checkpoints after steps 3 and 6
    _fit(logs, ck / "b", 10, ckpt_path=ck / "sstep=3.ckpt", shift=100.0)  # version_1 resumes at step 3: 3..9
    _fit(logs, ck / "c", 4)  # version_2: a fresh run, same hyper-parameters, from step 0
    _fit(logs, ck / "d", 10, ckpt_path=ck / "sstep=6.ckpt", lr=0.2)  # version_3: version_0's step 6, another lr
    _fit(logs, ck / "e", 12, ckpt_path=ck / "b" / "sstep=9.ckpt")  # version_4: version_1's step 9
    v = [logs / "gpt_tp" / f"version_{i}" for i in range(5)]
    parts = [read_metrics(d / "metrics.csv") for d in v]
    assert [p["train/loss"][0][0] for p in parts] == [0, 3, 0, 6, 9]  # what Lightning wrote
    assert [s for s, _ in parts[0]["train/loss"]] == list(range(6))

    csvs = [d / "metrics.csv" for d in v]
    assert run_csvs(csvs[0]) == [csvs[0]] and run_csvs(csvs[2]) == [csvs[2]]
    assert run_csvs(csvs[1]) == [csvs[0], csvs[1]]
    assert run_csvs(csvs[3]) == [csvs[0], csvs[3]]  # not its sibling version_1, though it overlaps steps 6..9
    assert run_csvs(csvs[4]) == [csvs[0], csvs[1], csvs[4]]

    joined = join(parts[:2])
    # steps 0..2 from version_0, 3..9 from version_1 (it redid 3..5: the later version wins)
    assert joined["train/loss"] == parts[0]["train/loss"][:3] + parts[1]["train/loss"]
    assert [s for s, _ in joined["train/loss"]] == list(range(10))
    assert [v > 100 for _, v in joined["train/loss"]] == [False] * 3 + [True] * 7
    assert joined["val/loss"] == parts[0]["val/loss"][:1] + parts[1]["val/loss"]

    out = main([str(v[3]), "-o", str(tmp_path / "run.png")])
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert capsys.readouterr().out == f"wrote {out} from {csvs[0]}, {csvs[3]}\n"  # the versions it drew
    # a folder of runs: the newest version's lineage
    assert run_csvs(find_csv(logs)) == [csvs[0], csvs[1], csvs[4]]
    # a log without lineage.json (not written by cli.py) is drawn alone
    (v[1] / "lineage.json").unlink()
    assert run_csvs(csvs[1]) == [csvs[1]] and run_csvs(csvs[4]) == [csvs[0], csvs[4]]


def test_a_single_point_is_drawn(tmp_path, monkeypatch):
    """A run that logged one train step (resumed for one step) gets a marker: a one-point line draws nothing."""
    import matplotlib.axes

    calls = []
    real = matplotlib.axes.Axes.plot

    def spy(ax, *args, **kw):
        calls.append((kw.get("label"), kw.get("marker")))
        return real(ax, *args, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    plot({"train/loss": [(40, 7.0)]}, tmp_path / "one.png", reference=False)
    plot({"train/loss": [(40, 7.0), (41, 6.9)]}, tmp_path / "two.png", reference=False)
    assert calls == [("train loss", "o"), ("train loss", None)]
