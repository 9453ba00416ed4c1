"""The ``kvport`` command line: one module per command group, wired together in :mod:`main`.

::

    main           the ``kvport`` group; each command's module is imported only when that command runs
    _run           run a click command with kvport's exit codes (2 bad input, 1 other kvport errors, 130 aborted)
    _params        option values (sizes, bandwidths, durations) parsed where click still knows the flag's name
    _fileopts      ``--config FILE``: a config file's keys as the defaults of a command's flags
    size_cmd       ``kvport size``: the KV size calculator and the ideal transfer lower bound
    serve_cmd      ``kvport serve``: the shared KV tier server (also ``python -m kvport.cli.serve_cmd``)
    inspect_cmd    ``kvport inspect``: usage, owners and leaks of a running server
    plan_cmd       ``kvport plan``: the planner's options, predicted times, choice and crossover for one request
    simulate_cmd   ``kvport simulate``: a trace replayed through a simulated prefill/decode deployment (--sweep)
    calibrate_cmd  ``kvport calibrate``: measure this machine and save the planner's profile
    eval_cmd       ``kvport eval quality``: codec quality on the reference model, as JSON
    bench_cmd      ``kvport bench SUITE``: run a benchmark suite, print its JSON report
    demo_cmd       ``kvport demo``: the main job
    report_cmd     ``kvport report``: the benchmarks' JSON (or quick/full runs) as an HTML page of figures and Markdown
    proxy_cmd      ``kvport proxy``: the OpenAI-API prefill/decode proxy in front of vLLM engines
    config_cmd     ``kvport config check FILE``: a config file's problems, each with its line and key
    doctor_cmd     ``kvport doctor``: what of kvport is installed and usable, each with the command that fixes it
"""
