"""The main job (``kvport demo``): prefill/decode disaggregation of long chats and agent sessions,
checked against a run without kvport. The worker processes it starts are :mod:`kvport.workers`. Modules::

    run          the transformers demo: the shared tier, a prefill and a decode worker, the baseline,
                 a decode worker restart, the report
    vllm_run     ``kvport demo --engine vllm``: kvport serve, prefill and decode ``vllm serve``, kvport proxy
    shared_tier  ``kvport serve`` (host + disk) as a subprocess on a free port
    report       per-turn rows, the summary and the table printed at the end
    sizing       the receive buffer, its budget and the tiers, sized from the spec before anything starts
"""
