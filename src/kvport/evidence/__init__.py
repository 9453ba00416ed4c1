"""Evidence beside every number: the physical limits of this machine, measured in the same run.

Below the benchmarks, the demo, the engines and the planner, so that each can measure what it is
compared with (and drop the page cache before a cold read) the same way. Modules::

    timing      time_it (median of trials, with min and max), gbps (decimal GB/s), ratio (None when a
                side is unknown)
    pagecache   drop_file_cache: the next read of a file comes from disk
    limits      memcpy, a raw loopback socket, raw file write + cold read, raw redis-py SET/GET
    rawserver   RawServer: a raw socket server under many clients, the loopback limit of a server
    netlink     emulated links between hosts: two network namespaces joined by a veth pair shaped
                with tc (ShapedLink, in_netns, LINKS), whether netem's delay could be applied
"""
