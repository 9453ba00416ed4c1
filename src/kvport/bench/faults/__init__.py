"""``kvport bench faults``: the fault benchmark. No fault changes an answer, nothing hangs, nothing
committed is lost (docs/faults.md). Modules, the transformers rows (the demo's worker processes,
:mod:`kvport.workers`) first, then the vLLM rows (``--set engine=vllm``)::

    suite         run(opts): the matrix of classes x injections, the control, the report
    classes       the fault class interface (prepare/before/during/after/finish), Injection, Control
    link          classes on the transfer path: kills, bit flips, repeated or missing frames, spec
                  rewrites, a slow reader, a partition
    storage       classes on the storage path: the shared tier killed or stalled, its disk damaged or
                  full, its pool full, leases, Redis restarted
    env           Setup (what a class needs) and Env (the running processes), the server-side checks
    router        the workers, their link through the fault proxy, one request at a time
    oracle        the chats and their answers computed once without kvport; compare
    procs         one handle per real component: kvport serve, redis-server, the fault proxy, a
                  network namespace, a tmpfs
    proxy         the frame-aware fault proxy process (``python -m kvport.bench.faults.proxy``)
    vllm          the vLLM rows: run(opts) and the tally
    vllm_env      the vLLM deployment under test: kvport serve, prefill and decode vllm serve, kvport proxy
    vllm_classes  the vLLM rows' fault classes
"""
