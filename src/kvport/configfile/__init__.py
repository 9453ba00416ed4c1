"""One config file for a deployment (TOML), read by ``kvport serve --config``, the vLLM and SGLang
connectors (``kvport_config`` in their extra config), ``kvport demo --config`` and checked by
``kvport config check``. docs/configuration.md says which entry point applies which key, beside an
example file of every key in docs/.

::

    lines   where each key of a TOML file is written (tomllib gives values, not lines)
    fields  the kinds of value (sizes, seconds, addresses, codecs, ...): parse or say why not
    keys    every key: its kind, its KVPORT_* variable, the typed field it fills
    schema  the typed, frozen objects a file becomes (KVPortConfig and its sections) and Problem
    reader  one pass over a parsed file: values converted, problems kept with their lines
    checks  checks across keys and of this machine (conflicts, sizes, RAM, disk room)
    load    load_config: parse, read, apply KVPORT_* variables, check, build

Precedence, highest first: a flag or key given explicitly to an entry point, a ``KVPORT_*``
variable (:func:`kvport.config.environ`: this package reads no variable itself), the file, the
entry point's default. A file with problems raises :class:`ConfigFileError` (a ``ConfigError``:
exit 2) listing each with its file, line and key; nothing is started.
"""

from kvport.configfile.fields import join_address
from kvport.configfile.keys import KEYS, env_name
from kvport.configfile.load import ConfigFileError, load_config
from kvport.configfile.reader import ROLES
from kvport.configfile.schema import KVPortConfig, Problem, TenantEntry

__all__ = ["KEYS", "ROLES", "ConfigFileError", "KVPortConfig", "Problem", "TenantEntry", "env_name", "join_address",
           "load_config"]
