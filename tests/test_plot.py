"""The plot command: a PNG from a small CSVLogger log, clear errors on a missing or empty one."""

import pytest

from gpt_tp.plot import PlotError, cli, find_csv, main, read_metrics

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
    with pytest.raises(SystemExit, match="^error: .*is empty"):  # the command: a message, exit status 1
        cli([str(tmp_path / "empty.csv"), "-o", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()
