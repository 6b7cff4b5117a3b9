"""Plot a run's losses and HellaSwag acc_norm like build-nanogpt's play.ipynb (docs/eval.md). Needs matplotlib."""

import contextlib
import csv
import json
import math
from pathlib import Path

from gpt_tp.entry import ArgumentParser, run
from gpt_tp.errors import UserError
from gpt_tp.train.logs import LINEAGE

REF_VAL_LOSS_GPT2 = 3.2924
REF_HELLASWAG_GPT2 = 0.2945
REF_HELLASWAG_GPT3 = 0.337
SERIES = ("train/loss", "val/loss", "hellaswag/acc_norm")


class PlotError(UserError):
    """A missing, empty or unusable log; the message says what was expected."""


def _trained(csv_path: Path) -> bool:
    """The log has a train/loss column: a fit's, not a validate run's."""
    with open(csv_path, newline="", encoding="utf-8") as f:
        return "train/loss" in (csv.DictReader(f).fieldnames or [])


def find_csv(path: str | Path) -> Path:
    """metrics.csv itself, a run dir's, or the newest fit's (else validate's) below a folder of runs such as logs/."""
    p = Path(path)
    if p.is_file():
        return p
    if (p / "metrics.csv").is_file():
        return p / "metrics.csv"
    if p.is_dir() and (found := sorted(p.rglob("metrics.csv"), key=lambda f: f.stat().st_mtime)):
        return ([f for f in found if _trained(f)] or found)[-1]
    what = f"no metrics.csv under {p}" if p.is_dir() else f"{p} not found"
    raise PlotError(f"{what}: pass a CSVLogger run dir (e.g. logs/gpt_tp/version_0) or its metrics.csv")


def _lineage(folder: Path) -> dict | None:
    """A version's lineage.json (gpt_tp.train.logs.RunLineage): {"run", "ancestors"}; None where there is none."""
    try:
        return json.loads((folder / LINEAGE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def run_csvs(csv_path: str | Path) -> list[Path]:
    """csv_path's run, oldest first: the metrics.csv of the versions beside it its lineage.json names, then its own."""
    csv_path = Path(csv_path)
    own = _lineage(csv_path.parent)
    if own is None:
        return [csv_path]
    by_run = {}
    for d in sorted(csv_path.parent.parent.iterdir()):
        if d != csv_path.parent and (d / "metrics.csv").is_file() and (lineage := _lineage(d)) is not None:
            by_run.setdefault(lineage.get("run"), d / "metrics.csv")
    return [by_run[run] for run in own.get("ancestors", []) if run in by_run] + [csv_path]


def join(parts: list[dict[str, list[tuple[int, float]]]]) -> dict[str, list[tuple[int, float]]]:
    """One curve per series from a run's versions, oldest first: a later one replaces the points from its first step."""
    out: dict[str, list[tuple[int, float]]] = {}
    for metrics in parts:
        start = min(points[0][0] for points in metrics.values())
        out = {k: [(s, v) for s, v in points if s < start] for k, points in out.items()}
        for k, points in metrics.items():
            out.setdefault(k, []).extend(points)
    return {k: sorted(v) for k, v in out.items() if v}


def read_metrics(csv_path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{series: [(step, value)]} for the SERIES found in a Lightning CSVLogger file (blank cells skipped)."""
    csv_path = Path(csv_path)
    with open(csv_path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames:
            raise PlotError(f"{csv_path} is empty: no header row (has the run logged a step yet?)")
        if "step" not in reader.fieldnames:
            raise PlotError(f"{csv_path} has no 'step' column: expected a Lightning CSVLogger metrics.csv, got columns {reader.fieldnames}")
        out: dict[str, list[tuple[int, float]]] = {k: [] for k in SERIES if k in reader.fieldnames}
        for lineno, row in enumerate(reader, start=2):
            for k in out:
                if not (v := (row.get(k) or "").strip()):
                    continue
                try:
                    out[k].append((int(float(row["step"])), float(v)))
                except ValueError as e:
                    raise PlotError(f"{csv_path}:{lineno}: cannot read step={row['step']!r} {k}={v!r} as numbers") from e
    if not (out := {k: sorted(v) for k, v in out.items() if v}):
        raise PlotError(f"{csv_path} holds no values of {', '.join(SERIES)}: nothing to plot")
    return out


def plot(metrics: dict[str, list[tuple[int, float]]], out: str | Path, title: str = "", reference: bool = True) -> Path:
    """Two panels: losses (with the GPT-2 124M val loss) and HellaSwag acc_norm (with GPT-2 / GPT-3 124M)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    finite = {k: [(s, v) for s, v in points if math.isfinite(v)] for k, points in metrics.items()}
    if not any(finite.values()):
        raise PlotError(f"every logged value of {', '.join(metrics)} is NaN or infinite: nothing to plot "
                        "(did the run diverge from its first step?)")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, 6))
    for key, label, kw in (("train/loss", "train loss", dict(lw=1, alpha=0.8)), ("val/loss", "val loss", dict(lw=2, marker="."))):
        if key in metrics:
            style = {**kw, "marker": "o"} if len(metrics[key]) == 1 else kw  # one point: a bare line draws nothing
            ax1.plot(*zip(*metrics[key]), label=label, **style)
            good = [v for _, v in finite[key]]
            ax1.set_title((f"min {label}: {min(good):.4f}" if key == "val/loss" else f"last {label}: {good[-1]:.4f}")
                          if good else f"{label}: no finite value", loc="left")
    losses = [v for k in ("train/loss", "val/loss") for _, v in finite.get(k, [])]
    if losses and reference and max(losses) < 2 * REF_VAL_LOSS_GPT2:  # build-nanogpt's 0-4 view once it is close
        ax1.set_ylim(0.0, max(4.0, max(losses) * 1.05))
    if finite.get("hellaswag/acc_norm"):
        ax2.plot(*zip(*metrics["hellaswag/acc_norm"]), marker=".", label="gpt_tp")
        ax2.set_title(f"max HellaSwag acc_norm: {max(v for _, v in finite['hellaswag/acc_norm']):.4f}", loc="left")
    else:
        ax2.set_title("no hellaswag/acc_norm logged", loc="left")
    if reference:
        ax1.axhline(REF_VAL_LOSS_GPT2, color="r", ls="--", label=f"OpenAI GPT-2 (124M) val loss {REF_VAL_LOSS_GPT2}")
        ax2.axhline(REF_HELLASWAG_GPT2, color="r", ls="--", label=f"OpenAI GPT-2 (124M) {REF_HELLASWAG_GPT2}")
        ax2.axhline(REF_HELLASWAG_GPT3, color="g", ls="--", label=f"OpenAI GPT-3 (124M) {REF_HELLASWAG_GPT3}")
    for ax, ylabel in ((ax1, "loss"), (ax2, "HellaSwag acc_norm")):
        ax.set(xlabel="step", ylabel=ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None) -> Path:
    ap = ArgumentParser("python -m gpt_tp.train.plot", "Plot train/val loss and HellaSwag acc_norm from a CSVLogger log; "
                        "a run resumed through cli.py is drawn with the runs it continues (their checkpoints).")
    ap.add_argument("run", help="metrics.csv, a run dir holding it, or a folder of runs (the newest metrics.csv is used)")
    ap.add_argument("-o", "--out", default="run.png", help="PNG to write (default: run.png in the current directory)")
    ap.add_argument("--no-reference", action="store_true", help="leave out the GPT-2 / GPT-3 reference lines")
    args = ap.parse_args(argv)
    if Path(args.out).is_dir():
        raise PlotError(f"--out {args.out} is a folder; give a PNG file name, e.g. --out {Path(args.out) / 'run.png'}")
    *ancestors, target = run_csvs(find_csv(args.run))
    parts = {}
    for c in ancestors:
        with contextlib.suppress(PlotError):  # an ancestor that logged nothing (requeued before its first step)
            parts[c] = read_metrics(c)
    parts[target] = read_metrics(target)
    csvs = list(parts)
    title = str(target) if len(csvs) == 1 else f"{target.parent.parent}: " + " + ".join(c.parent.name for c in csvs)
    out = plot(join(list(parts.values())), args.out, title=title, reference=not args.no_reference)
    print(f"wrote {out} from {', '.join(map(str, csvs))}")
    return out


if __name__ == "__main__":
    run(main)
