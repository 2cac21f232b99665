"""The latency sweep, its curve and the side-by-side video of `drive`: one row per (planner, latency), the
references driven once, a PNG, GIFs twice as wide as one episode's, and bad input refused in one line with
exit status 2 before any model is loaded.

A stub planner stands in for the model (it answers at once and reports a fixed decode time), and episodes
are 4 s (1 s of driving after the hand-over), so the whole file runs in seconds.
"""

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageSequence
from typer.testing import CliRunner

import fastddrive.drive.run as run_module
import fastddrive.planner as planner_module
from fastddrive.cli import app
from fastddrive.core.schema import CRITICAL_OBJECT_CLASSES, DrivingResponse, MetaBehavior
from fastddrive.data.highway import DEFAULT_SCENARIOS, REACTIVE_SCENARIOS, UnknownScenario
from fastddrive.decode.result import DecodeResult
from fastddrive.drive.latency import LatencyError, parse_named_ms, parse_sweep
from fastddrive.drive.latency_curve import draw_latency_curve, measured_marks
from fastddrive.drive.paired import excludes_zero, paired_difference
from fastddrive.drive.sweep import check_sweep, run_sweep
from fastddrive.drive.video import LABEL_PX, side_by_side_frames, write_side_by_side

runner = CliRunner()
MEASURED_MS = 40.0  # what the stub reports as its prefill + decode time
WIDTH, HEIGHT = 448, 224  # the simulator's frame


class StubPlanner:
    """Answers 'straight on at the current speed' at once, reporting MEASURED_MS of decoding."""

    calls = 0

    def plan(self, decoder, images, history, command, **options):
        self.calls += 1
        speed = float(history[-1, 2])
        response = DrivingResponse(
            critical_objects=dict.fromkeys(CRITICAL_OBJECT_CLASSES, False),
            explanation="keep going",
            future_meta_behavior=MetaBehavior(longitudinal="keep", lateral="lane_follow"),
            trajectory=[(speed * t, 0.0) for t in range(1, 6)],
        )
        return DecodeResult(decoder, [], "", response, 10, 0, 0, [], 0.4 * MEASURED_MS, 0.6 * MEASURED_MS)


def _settings(tmp_path, latency, **fields):
    fields = {"decoders": "ar,ss", "scenarios": "merge", "episodes": 1, "duration_s": 4.0, "out": tmp_path} | fields
    return check_sweep(latency, **fields)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """ar and ss at 0, 500 and 1500 ms with the references, one 4 s merge episode each, GIFs kept."""
    out = tmp_path_factory.mktemp("sweep")
    runs = _settings(out, "sweep:0,1500,500", video=out / "video")
    return out, runs, run_sweep(runs, StubPlanner())


def test_a_sweep_drives_each_latency_once_and_the_references_once(swept, monkeypatch):
    out, runs, report = swept
    assert [r.latency.fixed_ms for r in runs] == [{"ar": ms, "ss": ms} for ms in (0.0, 1500.0, 500.0)]
    assert [(row["decoder"], row["latency_ms"]) for row in report.rows] == [
        ("ar", 0.0),
        ("ar", 1500.0),
        ("ar", 500.0),
        ("ss", 0.0),
        ("ss", 1500.0),
        ("ss", 500.0),
        ("expert-drives", 0.0),
        ("expert-plans", 0.0),
        ("constant-velocity", 0.0),
    ]
    assert all(row["episodes"] == 1 and row["failed"] == 0 for row in report.rows)
    ar = {row["latency_ms"]: row for row in report.rows if row["decoder"] == "ar"}
    # A planner takes no question while it decodes: in 1 s of driving, fewer answers the slower it is.
    assert ar[0.0]["planner_calls"] >= ar[500.0]["planner_calls"] > ar[1500.0]["planner_calls"] >= 1
    assert {row["measured_ms"] for row in ar.values()} == {MEASURED_MS}
    assert len(list((out / "episodes").glob("*.json"))) == 3 * 2 + 3
    payload = report.to_json()
    assert payload["settings"]["latency"] == "sweep" and payload["settings"]["sweep_ms"] == [0.0, 1500.0, 500.0]
    # Paired over the same episodes: ss against ar at each latency, then each decoder against itself at the first.
    sides = [tuple((p[s]["planner"], p[s]["latency"]) for s in "ab") for p in payload["paired"]]
    at = {ms: f"fixed {ms} ms" for ms in (0, 500, 1500)}
    assert sides == [
        *((("ar", at[ms]), ("ss", at[ms])) for ms in (0, 1500, 500)),
        *(((d, at[0]), (d, at[ms])) for ms in (1500, 500) for d in ("ar", "ss")),
    ]
    assert all(p["episodes"] == 1 and p["interval_95"] is None for p in payload["paired"])  # one episode: no interval
    # Everything is on disk: a second sweep resumes without a model (loading one would fail here).
    monkeypatch.setattr(planner_module, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    started = []
    again = run_sweep(runs, on_start=lambda s, todo, done: started.append((s.latency.fixed_ms["ar"], todo, done)))
    assert started == [(0.0, 0, 5), (1500.0, 0, 2), (500.0, 0, 2)]
    assert [row["driving_score"] for row in again.rows] == [row["driving_score"] for row in report.rows]


def test_a_single_latency_is_one_run_with_its_own_rows(tmp_path):
    (run,) = _settings(tmp_path, "fixed:ar=250,ss=80", references=False)
    planner = StubPlanner()
    report = run_sweep([run], planner)
    # One untimed answer per decoder first: the rows' measured time is not the cold first call's.
    assert planner.calls == sum(row["planner_calls"] for row in report.rows) + 2
    assert report.sweep_ms is None and report.to_json()["settings"]["fixed_ms"] == {"ar": 250.0, "ss": 80.0}
    assert [(row["decoder"], row["latency_ms"]) for row in report.rows] == [("ar", 250.0), ("ss", 80.0)]
    png = draw_latency_curve(report.rows, tmp_path / "one-point.png")  # one point per decoder
    assert Image.open(png).size == (1320, 484)


def test_a_sweep_without_scenarios_named_drives_the_reactive_ones(tmp_path):
    # In the default scenarios nothing sudden happens and the curve is flat; the reactive ones show the cost.
    swept = check_sweep("sweep:0,1500", decoders="ss", episodes=1, out=tmp_path)
    assert [run.scenarios for run in swept] == [tuple(REACTIVE_SCENARIOS)] * 2
    (one,) = check_sweep("fixed:250", decoders="ss", episodes=1, out=tmp_path)
    assert one.scenarios == DEFAULT_SCENARIOS
    named = check_sweep("sweep:0,1500", decoders="ss", scenarios="merge", episodes=1, out=tmp_path)
    assert [run.scenarios for run in named] == [("merge",)] * 2
    with pytest.raises(UnknownScenario):  # an empty name is refused, not taken for the default
        check_sweep("sweep:0,1500", decoders="ss", scenarios="", episodes=1, out=tmp_path)


def test_the_latency_curve_is_a_png_with_the_marks_asked_for(swept, tmp_path):
    _, _, report = swept
    assert measured_marks(report.rows) == {"ar": MEASURED_MS, "ss": MEASURED_MS}
    measured = draw_latency_curve(report.rows, tmp_path / "measured.png", title=report.title)
    given = draw_latency_curve(report.rows, tmp_path / "given.png", {"ar": 1013.5, "ss": 84.7})
    for png in (measured, given):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
        with Image.open(png) as image:
            image.verify()
        assert Image.open(png).size == (1320, 484)  # 12 x 4.4 inches at 110 dpi
    assert Image.open(measured).tobytes() != Image.open(given).tobytes()


def _solid(colour, n, size=(WIDTH, HEIGHT)):
    return [Image.new("RGB", size, colour) for _ in range(n)]


def test_side_by_side_frames_hold_the_shorter_episodes_last_frame():
    left = _solid((255, 0, 0), 2) + _solid((0, 0, 255), 1)  # ends on blue after 3 frames
    right = _solid((0, 255, 0), 5)
    frames = side_by_side_frames(left, right, ("ar - latency fixed 1000 ms", "ss - latency fixed 85 ms"))
    assert len(frames) == 5 and {f.size for f in frames} == {(2 * WIDTH, HEIGHT + LABEL_PX)}
    middle = HEIGHT // 2 + LABEL_PX
    assert [f.getpixel((WIDTH // 2, middle)) for f in frames] == [(255, 0, 0)] * 2 + [(0, 0, 255)] * 3
    assert [f.getpixel((WIDTH + WIDTH // 2, middle)) for f in frames] == [(0, 255, 0)] * 5
    # The caption band is drawn on white: some dark text pixels in each half.
    band = frames[0].crop((0, 0, 2 * WIDTH, LABEL_PX))
    assert min(band.crop((0, 0, WIDTH, LABEL_PX)).getdata())[0] < 100
    assert min(band.crop((WIDTH, 0, 2 * WIDTH, LABEL_PX)).getdata())[0] < 100


def _gif(path, colours):
    images = [Image.new("RGB", (WIDTH, HEIGHT), c) for c in colours]
    images[0].save(path, save_all=True, append_images=images[1:], duration=250, loop=0)
    return path


def test_an_mp4_is_written_only_where_imageio_ffmpeg_is_installed(tmp_path, monkeypatch):
    left = _gif(tmp_path / "a.gif", [(255, 0, 0)] * 2)
    right = _gif(tmp_path / "b.gif", [(0, 255, 0)] * 3)
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # import fails: not installed
    assert write_side_by_side(left, right, ("a", "b"), tmp_path / "no" / "pair.gif") == [tmp_path / "no" / "pair.gif"]
    sent = []

    def write_frames(path, size, fps, macro_block_size):
        """imageio_ffmpeg's protocol: send(None) starts it, send(frame) writes one, close() ends the file."""
        assert size == (2 * WIDTH, HEIGHT + LABEL_PX) and fps == 4 and size[1] % macro_block_size == 0
        try:
            while True:
                sent.append((yield).shape)
        finally:
            Path(path).write_bytes(b"mp4")

    fake = types.SimpleNamespace(get_ffmpeg_exe=lambda: "ffmpeg", write_frames=write_frames)
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", fake)
    written = write_side_by_side(left, right, ("a", "b"), tmp_path / "yes" / "pair.gif")
    assert written == [tmp_path / "yes" / "pair.gif", tmp_path / "yes" / "pair.mp4"]
    assert sent == [(HEIGHT + LABEL_PX, 2 * WIDTH, 3)] * 3 and written[1].read_bytes() == b"mp4"


def test_the_command_sweeps_plots_and_writes_side_by_side_videos(tmp_path, monkeypatch):
    monkeypatch.setattr(planner_module, "load", lambda *a, **k: StubPlanner())
    out, video = tmp_path / "out", tmp_path / "video"
    args = ["--decoders", "ar,ss", "--scenarios", "merge", "--episodes", 1, "--duration-s", 4, "--no-references"]
    args += ["--out", out, "--video", video, "--json", tmp_path / "rows.json", "--plot", tmp_path / "curve.png"]
    args += ["--latency", "sweep:0,1000", "--mark", "ar=1013.5,ss=84.7", "--side-by-side", "ar,ss"]
    result = runner.invoke(app, ["drive", *(str(a) for a in args)])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert sorted((row["decoder"], row["latency_ms"]) for row in rows) == [
        ("ar", 0.0),
        ("ar", 1000.0),
        ("ss", 0.0),
        ("ss", 1000.0),
    ]
    assert Image.open(tmp_path / "curve.png").format == "PNG"
    pairs = sorted((video / "side-by-side").glob("*.gif"))
    seed = run_module.episode_seed(7, "merge", 0)
    assert [p.name for p in pairs] == [
        f"ar-fixed_0_ms-vs-ss-fixed_0_ms-merge-{seed}.gif",
        f"ar-fixed_1000_ms-vs-ss-fixed_1000_ms-merge-{seed}.gif",
    ]
    for pair in pairs:
        single = Image.open(video / pair.name.split("-vs-")[1])
        with Image.open(pair) as both:
            assert both.size == (2 * single.width, single.height + LABEL_PX)
            assert sum(1 for _ in ImageSequence.Iterator(both)) == single.n_frames


@pytest.fixture
def nothing_runs(monkeypatch):
    """Makes a model load or a driven episode fail loudly: a refusal must come before either."""
    monkeypatch.setattr(planner_module, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(run_module, "drive_episode", lambda *a, **k: pytest.fail("an episode was driven"))


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--latency", "sweep:"], "gives no latency"),
        (["--latency", "sweep: "], "gives no latency"),
        (["--latency", "sweep:0,-5"], "'-5' is not a latency"),
        (["--latency", "sweep:0,60001"], "0 to 60000"),
        (["--latency", "sweep:0,nan"], "0 to 60000"),
        (["--latency", "sweep:0,250,250.0"], "250 ms twice"),
        (["--latency", "sweep:0,250", "--plot", "curve.svg"], ".png"),
        (["--plot", "curve.png", "--mark", "tts=55"], "names 'tts', which is not a decoder"),
        (["--plot", "curve.png", "--mark", "ar=-1"], "0 to 60000"),
        (["--plot", "curve.png", "--mark", "ar"], "'ar' is not DECODER=MS"),
        (["--mark", "ar=1013.5"], "--mark needs --plot"),
        (["--video", "v", "--side-by-side", "ar"], "exactly two"),
        (["--video", "v", "--side-by-side", "ar,ss,ar"], "exactly two"),
        (["--video", "v", "--side-by-side", "ar,tts"], "'tts' is not a planner of this run"),
        (["--video", "v", "--side-by-side", "ar,expert-plans", "--no-references"], "'expert-plans' is not a planner"),
        (["--video", "v", "--side-by-side", "ss,ss"], "two different planners"),
        (["--side-by-side", "ar,ss"], "needs --video"),
        (["--workers", "0"], "--workers 0 is out of range"),
        (["--workers", "2"], "--workers 2 with --latency measured"),
    ],
)
def test_bad_sweep_plot_and_video_options_are_refused_in_one_line(tmp_path, monkeypatch, args, phrase, nothing_runs):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["drive", "--decoders", "ar,ss", "--out", "out", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert phrase in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_the_parsers_refuse_what_the_command_refuses(tmp_path):
    assert parse_sweep("fixed:250") is None and parse_sweep(" sweep:1500,0 ") == [1500.0, 0.0]
    with pytest.raises(LatencyError, match="twice"):
        parse_sweep("sweep:5,5")
    assert parse_named_ms("ss=84.7", ["ar", "ss"], "--mark 'ss=84.7'") == {"ss": 84.7}
    with pytest.raises(LatencyError, match="gives 'ar' twice"):
        parse_named_ms("ar=1,ar=2", ["ar"], "--mark")
    with pytest.raises(LatencyError, match="a list of runs"):
        run_module.check_settings(latency="sweep:0,250", out=tmp_path)
    with pytest.raises(LatencyError, match="needs a decoder"):
        check_sweep("sweep:0,250", decoders=[], references=True, out=tmp_path)


def _result(label: str, seed: int, score: float, scenario: str = "merge") -> dict:
    return {"label": label, "latency": "zero", "scenario": scenario, "seed": seed, "metrics": {"driving_score": score}}


def test_a_paired_difference_is_taken_episode_by_episode_over_the_episodes_both_drove():
    rng = np.random.default_rng(3)
    base = rng.uniform(0.2, 0.9, 40)  # the episodes differ far more than the planners do
    results = [_result("ar", seed, score) for seed, score in enumerate(base)]
    results += [_result("ss", seed, score + 0.02 + rng.normal(0, 0.01)) for seed, score in enumerate(base)]
    results += [_result("ss", 99, 1.0), _result("ar", 98, 0.0)]  # driven by one planner only: left out
    pair = paired_difference(results, ("ar", "zero"), ("ss", "zero"))
    assert pair["episodes"] == 40 and pair["mean_difference"] == pytest.approx(0.02, abs=0.005)
    low, high = pair["interval_95"]
    assert 0 < low < pair["mean_difference"] < high < 0.03 and excludes_zero(pair)
    assert paired_difference(results, ("ar", "zero"), ("ss", "zero")) == pair  # the same results, the same interval
    # Unpaired, the same scores would not tell the planners apart: their spread swamps the difference.
    assert np.std(base) / np.sqrt(40) > 0.02
    noise = [_result("ar", s, 0.5) for s in range(20)] + [_result("ss", s, 0.5 + (-1) ** s * 0.1) for s in range(20)]
    assert not excludes_zero(paired_difference(noise, ("ar", "zero"), ("ss", "zero")))
    alone = paired_difference([_result("ar", 1, 0.3), _result("ss", 1, 0.5)], ("ar", "zero"), ("ss", "zero"))
    assert alone["episodes"] == 1 and alone["interval_95"] is None and not excludes_zero(alone)
