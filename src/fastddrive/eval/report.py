"""The tables `fastddrive bench`, `eval` and `roofline` print, built from their rows (rich tables)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from rich.table import Table

from fastddrive.eval.accuracy import AccuracyReport
from fastddrive.eval.bench import BenchRow
from fastddrive.eval.roofline import Roofline


def bench_table(rows: Sequence[BenchRow], title: str) -> Table:
    """One line per decoder: cost, speed, speed-ups, ADE, invalid answers, equality with `ar`."""
    table = Table(title=title)
    columns = ("decoder", "NFE", "tok/NFE", "fed/fwd", "tok/s", "ms", "p90 ms", "prefill", "decode", "vs ar")
    columns = (*columns, "vs ar-jump", "vs AR model", "ADE@5s", "invalid", "same ids as ar")
    for column in columns:
        table.add_column(column, justify="left" if column == "decoder" else "right")
    for row in rows:
        table.add_row(
            row.label,
            f"{row.nfe:.0f}",
            f"{row.tokens_per_nfe:.2f}",
            f"{row.fed_per_forward:.1f}",
            f"{row.tokens_per_s:.0f}",
            f"{row.latency_ms:.1f}",
            f"{row.p90_latency_ms:.1f}",
            f"{row.prefill_ms:.1f}",
            f"{row.decode_ms:.1f}",
            *(
                "" if x is None else f"{x:.2f}x"
                for x in (row.speedup_vs_ar, row.speedup_vs_ar_jump, row.speedup_vs_baseline)
            ),
            "" if row.ade5 is None else f"{row.ade5:.3f}",
            str(row.invalid),
            "" if row.identical_to_ar is None else f"{row.identical_to_ar:.0%}",
        )
    return table


def accuracy_table(reports: Mapping[str, AccuracyReport], title: str) -> Table:
    """Constant velocity, then one line per decoder, in the official conventions."""
    table = Table(title=title)
    columns = ("decoder", "scored", "ADE@3s", "ADE@5s", "ADE@5s parsed", "RFS", "RFS parsed")
    columns += ("L2 avg ST-P3", "L2 avg UniAD", "coll. avg ST-P3 (raster)", "coll. avg ST-P3 (box)")
    for column in (*columns, "CO-F1", "lon acc", "lat acc", "invalid", "valid"):
        table.add_column(column, justify="left" if column == "decoder" else "right")
    first = next(iter(reports.values()))
    cv = ("constant velocity", str(first.scored), f"{first.cv_ade3_m:.3f}", f"{first.cv_ade5_m:.3f}")
    table.add_row(*cv, *[""] * (len(columns) + 5 - len(cv)))

    def percent(collision: dict | None) -> str:
        return f"{collision['stp3']['avg']:.2%}" if collision else ""

    for spec, r in reports.items():
        table.add_row(
            spec,
            str(r.scored),
            f"{r.ade3_m:.3f}",
            f"{r.ade5_m:.3f}",
            "" if r.ade5_parsed_m is None else f"{r.ade5_parsed_m:.3f}",
            "" if r.rfs is None else f"{r.rfs:.2f}",
            "" if r.rfs_parsed is None else f"{r.rfs_parsed:.2f}",
            f"{r.l2_m['stp3']['avg']:.3f}" if r.l2_m else "",
            f"{r.l2_m['uniad']['avg']:.3f}" if r.l2_m else "",
            percent(r.collision),
            percent(r.collision_box),
            f"{r.critical_object_f1:.3f}",
            f"{r.longitudinal_accuracy:.3f}",
            f"{r.lateral_accuracy:.3f}",
            str(r.invalid),
            f"{r.validity:.1%}",
        )
    return table


def scenario_table(reports: Mapping[str, AccuracyReport]) -> Table:
    """Official ADE@5s per scenario of every decoder and of constant velocity."""
    table = Table(title="ADE@5s per scenario (m), official: invalid answers as zero trajectories, scored frames")
    for column in ("scenario", "samples", *reports, "constant velocity"):
        table.add_column(column, justify="left" if column == "scenario" else "right")
    per_scenario = {spec: r.by_scenario() for spec, r in reports.items()}
    for name, row in next(iter(reports.values())).by_scenario().items():
        cells = [f"{per_scenario[spec][name]['ade5_m']:.3f}" for spec in reports]
        table.add_row(name, str(row["samples"]), *cells, f"{row['cv_ade5_m']:.3f}")
    return table


def accuracy_json(reports: Mapping[str, AccuracyReport]) -> dict[str, object]:
    """Every report's figures, with its validity and per-scenario ADE (the `eval --json` decoders)."""
    return {
        spec: dataclasses.asdict(r) | {"validity": r.validity, "by_scenario": r.by_scenario()}
        for spec, r in reports.items()
    }


def roofline_summary(result: Roofline, name: str, capture_s: float | None) -> str:
    """One line: the device, the prompt, the weight bytes a forward reads, bandwidth, floor and setup time."""
    return (
        f"{name}: {result.device}, {result.dtype}, prompt {result.prompt_tokens} tokens; weights read per forward "
        f"{result.weight_bytes / 1e9:.3f} GB, copy bandwidth {result.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
        f"floor {result.floor_ms:.3f} ms; prefill and warm-ups {result.setup_s:.1f} s"
        + (f" (CUDA graph warm-up and capture {capture_s:.1f} s)" if capture_s is not None else "")
    )


def roofline_table(result: Roofline, title: str) -> Table:
    """One line per token count: median, p10, p90, ms per token and the ratio to the floor."""
    table = Table(title=title)
    for column in ("tokens", "median ms", "p10 ms", "p90 ms", "ms/token", "x floor"):
        table.add_column(column, justify="right")
    for row in result.rows:
        table.add_row(
            str(row.tokens),
            f"{row.median_ms:.3f}",
            f"{row.p10_ms:.3f}",
            f"{row.p90_ms:.3f}",
            f"{row.ms_per_token:.4f}",
            f"{row.median_ms / result.floor_ms:.2f}x",
        )
    return table
