"""Figures of a dataset: samples per scenario and split, meta-behaviours, commands, critical objects, how
many explanations the scaffold's budget cuts, and the scaffold table (paper 000 Table 1)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rich.console import RenderableType
from rich.table import Table

from fastddrive.core.scaffold import Scaffold
from fastddrive.core.schema import parse
from fastddrive.data.dataset import SPLITS, DrivingDataset
from fastddrive.data.verify import unfinished


@dataclass
class DatasetStats:
    """Counts over every split of a dataset, with the scaffold they were measured against."""

    scaffold: Scaffold
    episodes: int | None
    unfinished: str | None  # why the data set is not complete (verify.unfinished); None when it is
    by_split: dict[str, Counter]  # split -> scenario -> samples
    end_reasons: Counter  # (scenario, reason) -> episodes
    longitudinal: Counter
    lateral: Counter
    commands: Counter
    critical_objects: Counter
    truncated: int
    explanation_tokens: list[int]  # sorted

    @property
    def samples(self) -> int:
        return sum(sum(c.values()) for c in self.by_split.values())

    def to_json(self) -> dict[str, object]:
        return {
            "complete": self.unfinished is None,
            "unfinished": self.unfinished,
            "samples": {s: sum(c.values()) for s, c in self.by_split.items()},
            "scenarios": {s: dict(c) for s, c in self.by_split.items()},
            "longitudinal": dict(self.longitudinal),
            "lateral": dict(self.lateral),
            "commands": dict(self.commands),
            "critical_objects": dict(self.critical_objects),
            "explanations_truncated": self.truncated,
            "scaffold": [
                {"section": r.section, "positions": r.positions, "scaffold": r.scaffold, "values": r.values}
                for r in self.scaffold.table()
            ],
        }

    def renderables(self) -> list[RenderableType]:
        """The tables and lines `fastddrive data stats` prints, in order."""
        title = "Samples per scenario" + (
            f" ({self.episodes} episodes)" if self.episodes and not self.unfinished else ""
        )
        scenarios = Table(title=title)
        scenarios.add_column("scenario")
        for split in SPLITS:
            scenarios.add_column(split, justify="right")
        for name in sorted({name for c in self.by_split.values() for name in c}):
            scenarios.add_row(name, *(str(self.by_split[s][name]) for s in SPLITS))
        scenarios.add_row("all", *(str(sum(self.by_split[s].values())) for s in SPLITS))
        out: list[RenderableType] = [scenarios]
        if self.unfinished:
            out.insert(0, f"[bold red]incomplete data set:[/] {self.unfinished}; the figures cover what is written")
        if self.end_reasons:
            endings = ", ".join(
                f"{scenario} {reason} {n}" for (scenario, reason), n in sorted(self.end_reasons.items())
            )
            out.append(f"episode endings (the expert's crashes are cut 5 s before): {endings}")
        total, lengths = self.samples, self.explanation_tokens
        out += [
            count_table("Longitudinal meta-behaviour", self.longitudinal, total),
            count_table("Lateral meta-behaviour", self.lateral, total),
            count_table("Navigation command", self.commands, total),
            count_table("Critical objects marked yes", self.critical_objects, total),
            f"explanations cut to fit the {self.scaffold.explanation_budget}-token budget: {self.truncated} of "
            f"{total} ({100 * self.truncated / total:.2f}%); explanation tokens median {lengths[len(lengths) // 2]}, "
            f"max {lengths[-1]}",
            scaffold_table(self.scaffold),
        ]
        return out


def dataset_stats(dataset: DrivingDataset, scaffold: Scaffold) -> DatasetStats:
    """Read every split of `dataset` once (a dataset without samples gives `samples == 0`)."""
    per_split = {s: dataset.table(s, columns=["scenario", "command", "response"]).to_pylist() for s in SPLITS}
    rows = [row for split in SPLITS for row in per_split[split]]
    responses = [parse(r["response"]) for r in rows]
    encoded = [scaffold.encode(r) for r in responses]
    slot = next(s for s in scaffold.slots if s.name == "explanation")
    reasons = dataset.manifest.get("end_reasons", {})
    settings = dataset.manifest["settings"]
    return DatasetStats(
        scaffold=scaffold,
        episodes=settings["episodes"] if settings.get("source") == "highway-env" else None,
        unfinished=unfinished(dataset),
        by_split={s: Counter(r["scenario"] for r in per_split[s]) for s in SPLITS},
        end_reasons=Counter((key.partition("-")[2] or key, reason) for key, reason in reasons.items()),
        longitudinal=Counter(r.future_meta_behavior.longitudinal for r in responses),
        lateral=Counter(r.future_meta_behavior.lateral for r in responses),
        commands=Counter(r["command"] for r in rows),
        critical_objects=Counter(name for r in responses for name, flag in r.critical_objects.items() if flag),
        truncated=sum(e.truncated for e in encoded),
        explanation_tokens=sorted(sum(t != scaffold.null_id for t in e.ids[slot.start : slot.end]) for e in encoded),
    )


def count_table(title: str, counts: Counter, total: int) -> Table:
    table = Table(title=title)
    table.add_column("value")
    table.add_column("samples", justify="right")
    table.add_column("share", justify="right")
    for value, n in counts.most_common():
        table.add_row(str(value), str(n), f"{100 * n / total:.1f}%")
    return table


def scaffold_table(scaffold: Scaffold) -> Table:
    table = Table(title="Response scaffold (paper 000 Table 1)")
    for column in ("section", "positions", "scaffold", "values", "value share"):
        table.add_column(column, justify="left" if column == "section" else "right")
    for row in scaffold.table():
        table.add_row(row.section, str(row.positions), str(row.scaffold), str(row.values), f"{row.value_share:.1%}")
    return table
