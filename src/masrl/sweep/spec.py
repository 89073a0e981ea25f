"""The sweep spec: YAML -> pydantic (strict, errors name the key), expanded into runs.

A spec names a base config, overrides applied to every run, ordered axes and seeds; the grid is
the product of the axes, and every cell runs once per seed. docs/study.md ("Running a sweep").
Paths (``base``, ``out``) are relative to the current directory, like every path in a masrl config.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator, StrictInt

from masrl.config import RunConfig, format_validation_error, load_config
from masrl.errors import ConfigError
from masrl.io.bounded_yaml import read_yaml_file

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")  # axis names and labels become folder names
Scalar = Union[bool, int, float, str]
MAX_CELL_NAME_BYTES = 255  # a cell's folder name (axis=label__...): the limit of ext4, XFS, APFS, NTFS
RESERVED = ("seed", "output_dir", "logging.progress")  # set by the sweep itself
MAX_RUNS = 10_000  # cells x seeds of one sweep (each run is a `masrl train` process)
MAX_SEEDS = 1_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Arm(_Strict):
    """One labelled value of an axis: overrides, and optionally a base config of its own."""

    base: Optional[str] = None
    overrides: list[str] = Field(default_factory=list)


class Axis(_Strict):
    """``{key: a.b, values: [...]}`` (label = str(value)) or ``{label: [overrides] | {base, overrides}}``."""

    key: Optional[str] = None
    values: Optional[list[Any]] = None
    arms: dict[str, Arm] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _labelled_form(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError("an axis is {key: a.b, values: [...]} or {label: [overrides], ...}")
        if {"key", "values"} & set(data):
            return data
        for label, arm in data.items():
            if not isinstance(arm, (list, dict)):
                raise ValueError(f"label {label!r}: give a list of overrides or {{base: ..., overrides: [...]}}, "
                                 f"got {arm!r}")
        return {"arms": {label: ({"overrides": v} if isinstance(v, list) else v) for label, v in data.items()}}

    @field_validator("values")
    @classmethod
    def _scalar_values(cls, values: Optional[list[Any]]) -> Optional[list[Any]]:
        for v in values or []:
            if not isinstance(v, (bool, int, float, str)):
                raise ValueError(f"value {v!r} is not a string, number or true/false; for lists, mappings or "
                                 "null use the labelled form {label: [key=value]}")
        return values

    @model_validator(mode="after")
    def _one_form(self):
        if self.key is not None or self.values is not None:
            if self.key is None or not self.values:
                raise ValueError("a value axis needs both 'key' (a dotted config key) and a non-empty 'values' list")
            self.arms = {_label(v): Arm(overrides=[f"{self.key}={_render(v)}"]) for v in self.values}
            if len(self.arms) != len(self.values):
                raise ValueError(f"values {self.values} give duplicate labels {[_label(v) for v in self.values]}")
        if not self.arms:
            raise ValueError("an axis needs at least one value: {key: a.b, values: [...]} or {label: [overrides]}")
        for label in self.arms:
            _check_name(label, "label")
        return self


class SweepSpec(_Strict):
    name: str
    base: str
    out: Optional[str] = None
    seeds: list[StrictInt] = Field(min_length=1)  # `true` is not seed 1 (YAML 1.1 booleans are refused)
    overrides: list[str] = Field(default_factory=list)
    axes: dict[str, Axis] = Field(min_length=1)

    @field_validator("seeds")
    @classmethod
    def _unique_seeds(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds repeat: {seeds}")
        if any(not 0 <= seed < 2 ** 32 for seed in seeds):
            raise ValueError(f"seeds must be in 0..{2 ** 32 - 1} (what torch and numpy accept)")
        return seeds

    @model_validator(mode="after")
    def _grid_size(self):
        """cells x seeds, computed before anything is expanded: a grid too large is refused at once."""
        if len(self.seeds) > MAX_SEEDS:
            raise ValueError(f"{len(self.seeds):,} seeds; the limit is {MAX_SEEDS:,}: split the seeds over several specs")
        cells = math.prod(len(axis.arms) for axis in self.axes.values())
        if cells * len(self.seeds) > MAX_RUNS:
            sizes = " x ".join(str(len(axis.arms)) for axis in self.axes.values())
            raise ValueError(f"the grid is {sizes} = {cells:,} cells x {len(self.seeds):,} seeds = "
                             f"{cells * len(self.seeds):,} runs; the limit is {MAX_RUNS:,} runs: use fewer axis values "
                             "or seeds, or split the sweep into several specs (each with its own out)")
        return self

    @model_validator(mode="after")
    def _names_and_reserved_keys(self):
        for axis in self.axes:
            _check_name(axis, "axis name")
        overrides = [("overrides", o) for o in self.overrides] + [
            (f"axes.{a}.{label}", o) for a, axis in self.axes.items() for label, arm in axis.arms.items()
            for o in arm.overrides]
        for where, item in overrides:
            key = item.partition("=")[0].strip()
            if "=" not in item:
                raise ValueError(f"{where}: override {item!r} is not of the form key.path=value")
            if key in RESERVED:
                raise ValueError(f"{where}: {key!r} is set by the sweep (seeds come from 'seeds:', the run folder "
                                 "from 'out:'); remove this override")
        return self


def _label(value: Scalar) -> str:
    return str(value)


def _render(value: Scalar) -> str:
    """A value as a dotted-override string that masrl's YAML parsing reads back as the same value."""
    return value if isinstance(value, str) else json.dumps(value)


def _check_name(name: str, what: str) -> None:
    if not NAME_RE.match(name) or "__" in name:
        raise ValueError(f"{what} {name!r} is used in folder names: use letters, digits and . _ + - "
                         "(not starting with a symbol, no '__')")


@dataclass(frozen=True)
class Cell:
    """One point of the grid: its labels by axis, its base config and its overrides (axis order)."""

    labels: tuple[tuple[str, str], ...]
    base: str
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        return cell_name(self.labels)


def cell_name(labels) -> str:
    return "__".join(f"{axis}={label}" for axis, label in labels)


def parse_cell_name(name: str) -> tuple[tuple[str, str], ...] | None:
    """``estimator=grpo__mapping=shared`` -> (("estimator", "grpo"), ("mapping", "shared")); None if not a cell."""
    parts = [p.partition("=") for p in name.split("__")]
    if not all(sep and a and label for a, sep, label in parts):
        return None
    return tuple((a, label) for a, _, label in parts)


@dataclass
class Run:
    cell: Cell
    seed: int
    out: Path
    spec_overrides: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # --quick overrides, after the cell's

    @property
    def run_dir(self) -> Path:
        return self.out / self.cell.name / f"seed{self.seed}"

    @property
    def log_path(self) -> Path:
        return self.out / self.cell.name / f"seed{self.seed}.log"

    @property
    def overrides(self) -> list[str]:
        return [f"seed={self.seed}", "logging.progress=false", *self.spec_overrides, *self.cell.overrides,
                *self.extra]

    def argv(self, python: str) -> list[str]:
        return [python, "-m", "masrl.cli", "train", self.cell.base, *self.overrides,
                "--output-dir", str(self.run_dir), "--overwrite"]

    def config(self) -> RunConfig:
        """The run's config, exactly as ``masrl train`` will build it from ``argv``."""
        return load_config(self.cell.base, self.overrides)


def load_spec(path: str | Path) -> SweepSpec:
    path = Path(path)
    data = read_yaml_file(path, "sweep spec") or {}  # the config limits: size, nesting, aliases, UTF-8
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping (name, base, seeds, axes, ...)")
    try:
        return SweepSpec.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e, str(path))) from None


def _format_error(err: ValidationError, source: str) -> str:
    return format_validation_error(err, source, hidden_loc=("arms",), root=SweepSpec, unknown_hint=(
        "a spec has name, base, out, seeds, overrides, axes; see docs/study.md"))


def expand_cells(spec: SweepSpec) -> list[Cell]:
    """The grid in axis order (the last axis varies fastest)."""
    cells = []
    axes = list(spec.axes.items())
    for combo in itertools.product(*[list(axis.arms.items()) for _, axis in axes]):
        labels = tuple((name, label) for (name, _), (label, _) in zip(axes, combo))
        bases = {f"axes.{name}.{label}": arm.base for (name, _), (label, arm) in zip(axes, combo) if arm.base}
        if len(bases) > 1:
            raise ConfigError(f"cell {cell_name(labels)}: two axes set a base config ({', '.join(bases)}); "
                              "only one axis may give a cell its own base")
        overrides = tuple(o for _, (_, arm) in zip(axes, combo) for o in arm.overrides)
        size = len(cell_name(labels).encode())
        if size > MAX_CELL_NAME_BYTES:
            raise ConfigError(f"cell {cell_name(labels)[:60]}...: its folder name would be {size} bytes; file systems "
                              f"allow {MAX_CELL_NAME_BYTES}: use shorter axis names and labels")
        cells.append(Cell(labels, next(iter(bases.values()), spec.base), overrides))
    return cells


def expand_runs(spec: SweepSpec, out: Path, extra: list[str] | None = None) -> list[Run]:
    """Every cell x seed, seed-major (all cells of the first seed first: paired comparisons come early)."""
    cells = expand_cells(spec)
    return [Run(cell, seed, out, list(spec.overrides), list(extra or [])) for seed in spec.seeds for cell in cells]


def check_bases(cells: list[Cell]) -> None:
    for base in sorted({c.base for c in cells}):
        if not Path(base).is_file():
            raise ConfigError(f"base config {base!r} does not exist (paths in a sweep spec are relative to the "
                              f"current directory, {Path.cwd()})")
