"""The report as one self-contained HTML page: every figure inline (SVG), its conditions on top.

No file beside it and nothing fetched: the page opens from a mail attachment or a CI artefact. Each
figure sits under a table of the conditions it was measured in (mode, date, commit, CPU and its
vector extensions, the memory kernels, load, the suite's own sizes and the limits measured in the
same run) and the command that regenerates it. An unknown figure says which fields it lacked.

A small script at the end marks the page ``data-figures-loaded="N/M"`` once every image decoded and
collects script errors in ``data-errors``: the browser check (:mod:`kvport.report.browser`) reads both.
"""

from __future__ import annotations

import base64
import html
import json
import time
from collections.abc import Sequence
from typing import Any

from kvport import __version__
from kvport.report.figures import Drawn
from kvport.report.results import Inputs, SuiteReport

COMMON = ("mode", "started", "commit", "command", "cpu", "cpu_isa", "memops", "cpu_count", "loadavg_start",
          "loadavg_end")
_SKIP = {"versions", "platform", "machine", *COMMON}
_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:2.2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;font-size:12px;margin:.4em 0}td,th{border:1px solid #ddd;padding:2px 6px;
text-align:left;vertical-align:top}th{background:#f4f4f4}code{font-size:12px;background:#f4f4f4;padding:1px 3px}
.unknown{background:#fff4e5;border:1px solid #f0c36d;padding:.6em}.note{color:#8a5a00}
img.fig{max-width:100%;display:block;margin:.6em 0}.cond{font-size:13px;margin:.2em 0}
details{font-size:12px;color:#444}.cap{color:#555;font-size:13px}
"""
_SCRIPT = """
(function(){
  var errors=[];
  window.addEventListener('error',function(e){errors.push(String(e.message||e));
    document.body.setAttribute('data-errors',errors.join(' | '));});
  window.addEventListener('load',function(){
    var imgs=document.querySelectorAll('img.fig'),ok=0;
    for(var i=0;i<imgs.length;i++){if(imgs[i].complete&&imgs[i].naturalWidth>0){ok++;}
      else{errors.push('figure did not render: '+imgs[i].id);}}
    document.body.setAttribute('data-figures-loaded',ok+'/'+imgs.length);
    document.body.setAttribute('data-errors',errors.join(' | '));
  });
})();
"""


def _fmt(v: Any) -> str:
    if v is None:
        return "unknown"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list | dict):
        text = json.dumps(v)
        return text if len(text) <= 160 else text[:157] + "..."
    return str(v)


def condition_rows(rep: SuiteReport) -> list[tuple[str, str]]:
    """The conditions of one report, the shared ones first; a missing one reads ``unknown``."""
    c, rows = rep.conditions, []
    for key in COMMON:
        if key != "command":
            rows.append((key, _fmt(c.get(key))))
    rows += [(k, _fmt(v)) for k, v in c.items() if k not in _SKIP]
    rows += [(f"limit: {k}", _fmt(v)) for k, v in rep.limits.items()]
    return rows


def _table(rows: Sequence[tuple[str, str]]) -> str:
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{cells}</table>"


def _figure_html(d: Drawn, inputs: Inputs) -> str:
    parts = [f'<section id="{d.key}"><h2>{html.escape(d.title)}</h2>']
    for rep in (inputs.reports[s] for s in d.suites):
        cmd = rep.conditions.get("command")
        parts.append(f"<p>From <code>{html.escape(rep.suite)}</code>"
                     + (f", regenerate with <code>{html.escape(str(cmd))}</code>" if cmd else
                        ", the command that made it is unknown")
                     + (f" (<code>{html.escape(str(rep.path))}</code>)" if rep.path else "") + "</p>")
        parts.extend(f'<p class="note">{html.escape(n)}</p>' for n in rep.notes)
        if rep.conditions.get("mode") == "quick":
            parts.append('<p class="note">A --quick run: smoke sizes and few trials, not figures to quote.</p>')
        parts.append(f'<p class="cond">{html.escape(rep.summary())}</p>')
        parts.append(f"<details><summary>all conditions and limits</summary>{_table(condition_rows(rep))}</details>")
    if d.svg is not None:
        data = base64.b64encode(d.svg.encode()).decode()
        parts.append(f'<img class="fig" id="fig-{d.key}" alt="{html.escape(d.title)}" '
                     f'src="data:image/svg+xml;base64,{data}">')
        parts.append(f'<p class="cap">{html.escape(d.caption)}</p>')
        if d.missing:
            parts.append('<p class="note">Left out (unknown): ' + html.escape("; ".join(d.missing)) + "</p>")
    else:
        parts.append('<div class="unknown">Unknown: ' + html.escape("; ".join(d.missing) or "no data")
                     + "</div>")
    parts.append("</section>")
    return "\n".join(parts)


def render(drawn: Sequence[Drawn], inputs: Inputs, title: str = "kvport report") -> str:
    known = sum(d.svg is not None for d in drawn)
    body = [f"<h1>{html.escape(title)}</h1>",
            f"<p>kvport {html.escape(__version__)}, written {time.strftime('%Y-%m-%d %H:%M:%S %z')}: "
            f"{known} of {len(drawn)} figures drawn; the others are unknown (not run, or fields missing). "
            "Figures from <code>--quick</code> runs are smoke runs, not results.</p>"]
    if inputs.refused:
        body.append("<h2>Files not read</h2>" + _table([(p, why) for p, why in inputs.refused]))
    body.append("<ul>" + "".join(f'<li><a href="#{d.key}">{html.escape(d.title)}</a>'
                                 + ("" if d.svg is not None else " (unknown)") + "</li>" for d in drawn) + "</ul>")
    body.extend(_figure_html(d, inputs) for d in drawn)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(body) + f"\n<script>{_SCRIPT}</script>\n</body></html>\n")
