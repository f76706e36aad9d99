"""The gradient log's line format (``format`` 1, :mod:`lowgrad.diagnostics.log` writes it),
checked once: :func:`check_record` (a step's line) and :func:`check_resumed` (the line a resumed
run writes first) are what :func:`~lowgrad.diagnostics.log.read_log` applies to every line, so
every reader (``tools/grad_report.py``) gets well-formed records or a ValueError naming the line
and the field, never a KeyError or TypeError of its own later."""
from __future__ import annotations

import math
from typing import Any

#: the format number every line carries first (``{"format": 1, "step": ...}``)
FORMAT = 1
#: the key of the line a resumed run writes before its first record:
#: ``{"format": 1, "resumed": {"step": S}}``; the lines above it of step >= S are superseded
RESUMED = "resumed"


def _where(path: str, key: str | int) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key


def _field(obj: dict[str, Any], path: str, key: str) -> Any:
    if key not in obj:
        raise ValueError(f"{_where(path, key)} is missing")
    return obj[key]


def _object(value: Any, path: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{path or 'the line'} must be a JSON object, got {value!r:.60}")
    for key in keys:
        _field(value, path, key)
    return value


def _int(value: Any, path: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{path} must be an integer >= {low}, got {value!r:.60}")
    return value


def _number(value: Any, path: str, null: bool = False, low: float = -math.inf) -> None:
    """A finite number >= ``low`` (non-finite ones are written as null: NaN is no number here)."""
    if value is None and null:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < math.inf:
        want = "a finite number" + ("" if low == -math.inf else f" >= {low:g}") + (" or null" if null else "")
        raise ValueError(f"{path} must be {want}, got {value!r:.60}")


def _string(value: Any, path: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{path} must be a non-empty string, got {value!r:.60}")


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{path} must be a list, got {value!r:.60}")
    return value


_ESTIMATE = ("g2", "trace", "b_simple")
_NOISE = (*_ESTIMATE, "ema")
_SUMMARY = ("norm", "nonfinite", "maxabs", "noise", "noise_local")
_REPORT = ("message", "step", "parameter", "layer", "source", "micro_step", "rank", "count", "tensors", "ranks",
           "world")


def _check_noise(value: Any, path: str) -> None:
    if value is None:
        return
    noise = _object(value, path, _NOISE)
    for key in _ESTIMATE:
        _number(noise[key], _where(path, key), null=True)
    if noise["ema"] is not None:
        ema = _object(noise["ema"], _where(path, "ema"), _ESTIMATE)
        for key in _ESTIMATE:
            _number(ema[key], _where(path, f"ema.{key}"), null=True)


def _check_summary(value: dict[str, Any], path: str) -> None:
    _number(value["norm"], _where(path, "norm"), null=True, low=0)
    _int(value["nonfinite"], _where(path, "nonfinite"), 0)
    _number(value["maxabs"], _where(path, "maxabs"), low=0)
    _check_noise(value["noise"], _where(path, "noise"))
    _check_noise(value["noise_local"], _where(path, "noise_local"))


def check_record(record: Any) -> dict[str, Any]:
    """``record`` (a parsed line) if it is a well-formed record of this format: every field
    present with its type and range (the module's docstring); ValueError naming the first field
    that is not (``global.noise.b_simple must be a finite number or null, got 'x'``)."""
    if not isinstance(record, dict) or record.get("format") != FORMAT or isinstance(record["format"], bool):
        raise ValueError(f"not a gradient log line of format {FORMAT}")
    _object(record, "", ("step", "rank", "world", "micro_steps", "batch", "skipped", "global", "layers", "nonfinite"))
    _int(record["step"], "step", 0)
    world = _int(record["world"], "world", 1)
    if _int(record["rank"], "rank", 0) >= world:
        raise ValueError(f"rank must be below world {world}, got {record['rank']}")
    _int(record["micro_steps"], "micro_steps", 1)
    batch = _object(record["batch"], "batch", ("micro", "local", "step"))
    for key in ("micro", "local", "step"):
        _int(batch[key], f"batch.{key}", 1)
    if not isinstance(record["skipped"], bool):
        raise ValueError(f"skipped must be true or false, got {record['skipped']!r:.60}")
    _check_summary(_object(record["global"], "global", _SUMMARY), "global")
    for i, layer in enumerate(_list(record["layers"], "layers")):
        entry = _object(layer, f"layers[{i}]", ("layer", *_SUMMARY))
        _int(entry["layer"], f"layers[{i}].layer", -1)
        _check_summary(entry, f"layers[{i}]")
    for i, tensor in enumerate(_list(record["tensors"], "tensors") if "tensors" in record else ()):
        path = f"tensors[{i}]"
        entry = _object(tensor, path, ("name", "layer", "norm", "nonfinite", "maxabs", "micro_norms"))
        _string(entry["name"], f"{path}.name")
        _int(entry["layer"], f"{path}.layer", -1)
        _number(entry["norm"], f"{path}.norm", null=True, low=0)
        _int(entry["nonfinite"], f"{path}.nonfinite", 0)
        _number(entry["maxabs"], f"{path}.maxabs", low=0)
        if entry["micro_norms"] is not None:
            for j, x in enumerate(_list(entry["micro_norms"], f"{path}.micro_norms")):
                _number(x, f"{path}.micro_norms[{j}]", null=True, low=0)
    if record["nonfinite"] is not None:
        report = _object(record["nonfinite"], "nonfinite", _REPORT)
        _string(report["message"], "nonfinite.message")
        _string(report["parameter"], "nonfinite.parameter")
        if report["source"] not in ("local", "micro", "step"):
            raise ValueError(f"nonfinite.source must be local, micro or step, got {report['source']!r:.60}")
        for key, low in (("step", 0), ("layer", -1), ("rank", 0), ("count", 1), ("tensors", 1), ("ranks", 1),
                         ("world", 1)):
            _int(report[key], f"nonfinite.{key}", low)
        if report["micro_step"] is not None:
            _int(report["micro_step"], "nonfinite.micro_step", 0)
    return record


def check_resumed(line: Any) -> int:
    """The step S of a resumed run's line ``{"format": 1, "resumed": {"step": S}}`` (every line
    above it of step >= S is superseded: written between the checkpoint and the crash, and
    written again after it); ValueError naming the field unless it is exactly that."""
    if not isinstance(line, dict) or set(line) != {"format", RESUMED} or line["format"] != FORMAT \
            or isinstance(line["format"], bool):
        raise ValueError(f"a resumed line is exactly {{\"format\": {FORMAT}, \"{RESUMED}\": {{\"step\": S}}}}, "
                         f"got {line!r:.80}")
    marker = _object(line[RESUMED], RESUMED, ("step",))
    if set(marker) != {"step"}:
        raise ValueError(f"{RESUMED} must hold only step, got {sorted(marker)}")
    return _int(marker["step"], f"{RESUMED}.step", 0)
