"""`kvwise report DIR`: every benchmark report under DIR on one static HTML page.

Each folder with a report (a Markdown table beside its JSON, as every `kvwise bench` writes)
becomes a section: its tables, its plots, and the system and configuration of the run. The page
needs nothing but itself: images are embedded as data URIs, the style is inline, there is no
script from a CDN, so it opens offline and can be mailed or archived as one file.
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 72rem; padding: 0 1rem; color: #222; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.25rem; margin-top: 2.5rem; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 0.85rem; display: block; overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.5rem; text-align: right; white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; }
img { max-width: 100%; margin: 0.5rem 0; border: 1px solid #eee; }
pre { background: #f6f6f6; padding: 0.6rem; overflow-x: auto; font-size: 0.8rem; }
nav li { margin: 0.15rem 0; }
"""


def render_report(directory: str | Path, out: str | Path | None = None) -> Path:
    """Write the page for every report under `directory` (default out: directory/report.html)."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory")
    folders = sorted({path.parent for path in root.rglob("*.md")})
    if not folders:
        raise ValueError(f"no benchmark reports (a .md table beside its .json) under {root}")
    sections, contents = [], []
    for folder in folders:
        anchor = re.sub(r"[^a-z0-9]+", "-", str(folder.relative_to(root)).lower()).strip("-") or "top"
        title = str(folder.relative_to(root)) if folder != root else root.name
        contents.append(f'<li><a href="#{anchor}">{html.escape(title)}</a></li>')
        sections.append(_section(folder, anchor, title))
    page = (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>kvwise benchmarks: {html.escape(root.name)}</title><style>{STYLE}</style></head><body>"
        f"<h1>kvwise benchmarks: {html.escape(root.name)}</h1><nav><ul>{''.join(contents)}</ul></nav>"
        + "".join(sections)
        + "</body></html>\n"
    )
    target = Path(out) if out is not None else root / "report.html"
    target.write_text(page, encoding="utf-8")
    return target


def _section(folder: Path, anchor: str, title: str) -> str:
    parts = [f'<section id="{anchor}"><h2>{html.escape(title)}</h2>']
    for table in sorted(folder.glob("*.md")):
        parts.append(markdown_to_html(table.read_text(encoding="utf-8")))
    for image in sorted(folder.glob("*.png")):
        data = base64.b64encode(image.read_bytes()).decode()
        parts.append(f'<img alt="{html.escape(image.stem)}" src="data:image/png;base64,{data}">')
    for report in sorted(folder.glob("*.json")):
        run = _run_description(report)
        if run:
            parts.append(f"<details><summary>system and configuration ({html.escape(report.name)})</summary>")
            parts.append(f"<pre>{html.escape(run)}</pre></details>")
    parts.append("</section>")
    return "".join(parts)


def _run_description(report: Path) -> str | None:
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    described = {key: data[key] for key in ("system", "config") if key in data}
    return json.dumps(described, indent=1, default=str) if described else None


def markdown_to_html(text: str) -> str:
    """The Markdown the benches write: pipe tables, fenced code, lists and paragraphs."""
    blocks, lines, index = [], text.splitlines(), 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("```"):
            end = next((i for i in range(index + 1, len(lines)) if lines[i].startswith("```")), len(lines))
            blocks.append(f"<pre>{html.escape(chr(10).join(lines[index + 1 : end]))}</pre>")
            index = end + 1
        elif line.startswith("|"):
            end = index
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            blocks.append(_table(lines[index:end]))
            index = end
        elif line.startswith(("- ", "* ")):
            end = index
            while end < len(lines) and lines[end].startswith(("- ", "* ")):
                end += 1
            items = "".join(f"<li>{_inline(item[2:])}</li>" for item in lines[index:end])
            blocks.append(f"<ul>{items}</ul>")
            index = end
        elif line.startswith("#"):
            level = min(6, len(line) - len(line.lstrip("#")) + 2)
            blocks.append(f"<h{level}>{_inline(line.lstrip('#').strip())}</h{level}>")
            index += 1
        elif line.strip():
            end = index
            while end < len(lines) and lines[end].strip() and not lines[end].startswith(("|", "```", "- ", "#")):
                end += 1
            blocks.append(f"<p>{_inline(' '.join(lines[index:end]))}</p>")
            index = end
        else:
            index += 1
    return "\n".join(blocks)


def _table(rows: list[str]) -> str:
    cells = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows]
    body = [row for row in cells if not all(re.fullmatch(r":?-+:?", cell) for cell in row if cell)]
    head, rest = body[0], body[1:]
    header = "".join(f"<th>{_inline(cell)}</th>" for cell in head)
    rows_html = "".join("<tr>" + "".join(f"<td>{_inline(cell)}</td>" for cell in row) + "</tr>" for row in rest)
    return f"<table><thead><tr>{header}</tr></thead><tbody>{rows_html}</tbody></table>"


def _inline(text: str) -> str:
    text = html.escape(text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
