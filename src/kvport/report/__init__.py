"""``kvport report``: the benchmarks' JSON as one HTML page of figures, and as the Markdown reference.

::

    kvport bench SUITE --json  -->  results   read and check reports; fields looked up or unknown
                                       |
                                    figures   one matplotlib figure per question (TTFT against length,
                                       |      hit rate against capacity, throughput against the limit,
                                       |      codec size against quality, overload over time, the demo)
                     +-----------------+-----------------+
                   page (HTML, inline SVG,          markdown (docs/benchmarks.md: the current figures
                   conditions on top)               per suite, conditions, command)
                     |
                   browser: Chromium renders the page; figures and console checked

Modules::

    results    SuiteReport, Inputs, load (files refused with their reason), Fields (missing = unknown)
    figures    FIGURES and draw_all: each figure drawn, or unknown naming what it lacked (matplotlib)
    page       render: the self-contained HTML page
    markdown   render: the per-suite Markdown reference (no plots, no extra)
    browser    check: the page in headless Chromium, figures decoded, console clean
    run        build: run the suites (or read their JSON), write the page and the Markdown
"""
