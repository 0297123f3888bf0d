"""Every pool instance's /metrics as one Prometheus text: each sample gains its `pool` and
`instance` labels, and the samples of one metric family stay together under one HELP and TYPE
line (the text format wants a family in one block, not one block per instance)."""

from __future__ import annotations


def merge_metrics(texts: list[tuple[dict[str, str], str]]) -> str:
    """`texts`: (labels to add, an instance's /metrics text) each."""
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for labels, text in texts:
        extra = ",".join(f'{name}="{value}"' for name, value in labels.items())
        family = ""
        for line in text.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    heads.setdefault(family, [])
                    if len(heads[family]) < 2 and line not in heads[family]:
                        heads[family].append(line)
                continue
            if not line.strip():
                continue
            samples.setdefault(family, []).append(_labelled(line, extra))
    out = []
    for family, lines in heads.items():
        out += lines + samples.get(family, [])
    return "\n".join(out) + "\n" if out else ""


def _labelled(line: str, extra: str) -> str:
    """`name{a="b"} 1.0` -> `name{pool="x",instance="0",a="b"} 1.0`."""
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and brace < space:
        name, rest = line[:brace], line[brace + 1:]
        return f"{name}{{{extra},{rest}" if not rest.startswith("}") else f"{name}{{{extra}{rest}"
    name, rest = line[:space], line[space:]
    return f"{name}{{{extra}}}{rest}"
