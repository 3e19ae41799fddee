"""Settings: one table of defaults, read from flags, a TOML file and KVTIER_* variables.

The table SETTINGS is the only list of settings. The CLI builds its flags from it, the README's
configuration table is generated from it (``kvtier config --markdown``), and ``load`` validates
every value at start-up, so a typo in a config file is an error that names the setting rather
than a silently ignored key. Precedence, lowest first: defaults, TOML file, environment, flags.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvtier.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2,
          "gib": 1024**3, "tib": 1024**4}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

WRITE_POLICIES = ("write_through", "write_back")
EVICTION_POLICIES = ("chain", "s3fifo", "lru")    # kvtier.coherence.policies.POLICIES
TIER_LABELS = ("hbm", "host", "nvme")


def parse_size(value: str | int, name: str = "size") -> int:
    """'4GiB' -> 4294967296. Plain integers are bytes. Raises ConfigError naming the setting."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size like 4GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: a size cannot be negative ({value})")
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}: expected a size like 512MiB or 4GiB, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_hostport(value: str, name: str = "admin") -> tuple[str, int]:
    host, sep, port = str(value).rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name}: expected HOST:PORT such as 127.0.0.1:8787, got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _choice(options: tuple[str, ...]) -> Callable[[Any, str], str]:
    def check(value: Any, name: str) -> str:
        if value not in options:
            raise ConfigError(f"{name}: {value!r} is not one of {', '.join(options)}")
        return str(value)
    return check


def _float(value: Any, name: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(out):
        # nan passes every range check below (and ends as a ValueError in settimeout);
        # inf overflows socket timeouts (OverflowError) and never ends a wait.
        raise ConfigError(f"{name}: expected a finite number, got {value!r}")
    if out < 0:
        raise ConfigError(f"{name}: must not be negative, got {value!r}")
    return out


# On a host of at least this many usable cores (a GPU server's) busy_poll_us "auto" is
# BUSY_POLL_LONG_US, else BUSY_POLL_SHORT_US. A GPU worker's get of 4,096 small blocks waits 2-6
# ms on the GPU between requests: past a 1 ms window the service's loop is asleep when the next
# get's first request comes, and on an H100 host that request waited 0.10-0.28 ms for the loop
# to wake, against 0.11-0.18 with 10 ms (bench/results/s37-h100-busy; docs/DESIGN-NOTES.md,
# "the service's busy-poll window"). One core of eight or more spinning while such a worker is
# active is the price; on fewer cores it would take a core from the workers.
BUSY_POLL_CORES = 8
BUSY_POLL_LONG_US = 10000.0
BUSY_POLL_SHORT_US = 1000.0


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_busy_poll_us(cores: int | None = None) -> float:
    """busy_poll_us "auto": BUSY_POLL_LONG_US on BUSY_POLL_CORES or more, else BUSY_POLL_SHORT_US."""
    cores = usable_cores() if cores is None else cores
    return BUSY_POLL_LONG_US if cores >= BUSY_POLL_CORES else BUSY_POLL_SHORT_US


def _busy_poll(value: Any, name: str) -> float:
    if value == "auto":
        return auto_busy_poll_us()
    return _float(value, name)


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
    if out < 0:
        raise ConfigError(f"{name}: must not be negative, got {value!r}")
    return out


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    return value


def _uids(value: Any, name: str) -> tuple[int, ...]:
    items = value.split(",") if isinstance(value, str) else value
    try:
        return tuple(int(x) for x in items if str(x).strip() != "")
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected a list of numeric uids, got {value!r}") from None


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected true or false, got {value!r}")


POLICY_PARAMETERS = ("small", "ghost", "freq_max", "leaf_first")


def tier_values(value: str, name: str) -> dict[str, str]:
    """'4x' -> that value for every tier; 'host:4x,hbm:2x' -> per tier. ConfigError otherwise."""
    text = value.strip()
    if not text:
        return {}
    if ":" not in text:
        return {t: text for t in TIER_LABELS}
    out: dict[str, str] = {}
    for part in text.split(","):
        tier, sep, v = part.partition(":")
        tier = tier.strip().lower()
        if not sep or tier not in TIER_LABELS or not v.strip():
            raise ConfigError(f"{name}: expected one value or tier:value pairs such as "
                              f"host:4x,hbm:2x (tiers: {', '.join(TIER_LABELS)}), got {value!r}")
        out[tier] = v.strip()
    return out


def _per_tier(value: Any, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{name}: expected a value or tier:value pairs, got {value!r}")
    text = str(value)
    from kvtier.coherence.policies import parse_param   # the policy table checks the values
    for v in tier_values(text, name).values():
        parse_param(name.removeprefix("eviction_"), v)
    return text


def _size(value: Any, name: str) -> int:
    return parse_size(value, name)


def _hostport(value: Any, name: str) -> str:
    if value in ("", None):
        return ""                      # disabled
    parse_hostport(value, name)
    return str(value)


@dataclass(slots=True, frozen=True)
class Setting:
    name: str
    default: Any
    parse: Callable[[Any, str], Any]
    help: str
    unit: str = ""


SETTINGS: tuple[Setting, ...] = (
    Setting("data_dir", "./kvtier-data", _str, "NVMe segments, LMDB and the admin token live here"),
    Setting("socket", "", _str, "Unix socket path; empty: <data_dir>/run/kvtier.sock"),
    Setting("admin", "127.0.0.1:8787", _hostport, "admin REST HOST:PORT; empty string disables"),
    Setting("admin_token", "", _str, "bearer token for POST /v1/flush and /v1/evict"),
    Setting("admin_hosts", "", _str,
            "comma-separated host names the admin API answers to besides IP literals and "
            "localhost (any other Host header gets 421: a guard against DNS rebinding)"),
    Setting("admin_max_body", "64KiB", _size,
            "largest admin request body (they are small JSON); larger gets 413 unread",
            "bytes"),
    Setting("host_capacity", "1GiB", _size, "shared host-tier bytes, all namespaces", "bytes"),
    Setting("nvme_capacity", "16GiB", _size, "NVMe log bytes, all namespaces; 0 disables", "bytes"),
    Setting("hbm_capacity", "0", _size, "HBM pool bytes per GPU; ignored without CUDA", "bytes"),
    Setting("hbm_reserve", "fixed", _choice(("fixed", "history")),
            "fixed: each namespace's HBM pool is hbm_capacity; history: sized from the peak "
            "demand of earlier runs, sum of peak_i x alpha^i, at most hbm_capacity"),
    Setting("hbm_reserve_alpha", 0.7, _float, "history: the weight of each older run's peak",
            "fraction"),
    Setting("gpu_copy_engine_bytes", "1MiB", _size,
            "a worker's CUDA transfers move pages at least this large by copy engines (no SMs "
            "taken from the model), smaller ones by an SM-bounded kernel", "bytes"),
    Setting("gpu_onboard_copy_engine_bytes", "64KiB", _size,
            "a worker's CUDA gets of whole host pages at least this large (and below "
            "gpu_copy_engine_bytes) go by copy engines too; 0: gpu_copy_engine_bytes alone decides",
            "bytes"),
    Setting("gpu_sorted_gets", "auto", _choice(("auto", "on", "off")),
            "a worker's CUDA gets of 2,049-4,096 blocks of small pages leased in the service's "
            "slot order and moved by copy engines through device staging (else in chunks, read "
            "by the SM-bounded kernel); auto: rows under gpu_onboard_copy_engine_bytes, where "
            "the GPU's SMs read mapped host memory below 0.75 of a copy engine's rate, measured "
            "once per GPU by kvtier.gpu.warm() (the vLLM connector calls it)"),
    Setting("gpu_kernel_blocks", 16, _int,
            "thread blocks (so SMs, at most) of the transfer kernel between host and GPU"),
    Setting("gpu_device_kernel_blocks", 0, _int,
            "thread blocks of the HBM tier's device-to-device kernel; 0: two per SM"),
    Setting("gpu_place_blocks", 0, _int,
            "thread blocks of a worker's placement kernels (a staged get's pages from device "
            "staging into the engine's tensors); 0: one per SM"),
    Setting("write_policy", "write_through", _choice(WRITE_POLICIES),
            "write_through: a put is on NVMe when acknowledged; write_back: flushed later"),
    Setting("eviction", "chain", _choice(EVICTION_POLICIES),
            "eviction policy of every tier: chain (S3-FIFO for prefix chains), s3fifo, lru"),
    Setting("eviction_host", "", _str,
            "host-tier policy; empty: the value of eviction (chain runs lru in host under an "
            "HBM tier)"),
    Setting("eviction_nvme", "", _str, "NVMe-tier policy; empty: the value of eviction"),
    Setting("eviction_hbm", "", _str, "HBM-tier policy; empty: the value of eviction"),
    Setting("eviction_small", "", _per_tier,
            "s3fifo/chain: the probation queue's share of the tier; one value, or tier:value "
            "pairs (host:0.1,hbm:0.2); empty: the policy's own (chain 0.02, s3fifo 0.1)",
            "fraction"),
    Setting("eviction_ghost", "", _per_tier,
            "s3fifo/chain: evicted keys remembered, as a multiple of the tier (4x) or in blocks "
            "(100000); 28-56 bytes each; empty: the policy's own (chain 4x, s3fifo 0.9x)"),
    Setting("eviction_freq_max", "", _per_tier,
            "s3fifo/chain: limit of the main queue's aging counter (3); empty: the policy's own"),
    Setting("eviction_leaf_first", "", _per_tier,
            "s3fifo/chain: a put batch enters the queues deepest block first, so a chain loses "
            "its leaves before its parents (chain: true, s3fifo: false); empty: the policy's own"),
    Setting("prefetch_blocks", 8, _int,
            "after a get, bring up to this many next blocks of the chain from NVMe to host; "
            "0 disables"),
    Setting("flush_interval", 1.0, _float, "write_back: seconds between background flushes", "s"),
    Setting("checkpoint_interval", 1.0, _float,
            "seconds LMDB may lag the NVMe log's batch headers (replayed at restart); "
            "deletes and reclaims commit at once", "s"),
    Setting("segment_bytes", "256MiB", _size,
            "size at which an NVMe segment file rolls over; the service keeps one reclaim "
            "read buffer of this size mapped, and the pages reclaims touched stay resident "
            "(up to half a segment at the default compact_threshold)",
            "bytes"),
    Setting("compact_threshold", 0.5, _float,
            "compact a segment when its live fraction falls below this (once the NVMe tier is "
            "3/4 full)", "fraction"),
    Setting("reserve_timeout", 30.0, _float, "a put reservation not committed by then is reclaimed",
            "s"),
    Setting("lease_timeout", 600.0, _float, "a get lease not released by then is reclaimed", "s"),
    Setting("max_client_share", 0.75, _float,
            "fraction of a namespace's host slots that one connection's leases and reservations "
            "may pin; the rest stays free for other clients' gets and puts (a pipelined "
            "client pins up to about two batches at once)", "fraction"),
    Setting("io_threads", 4, _int, "threads issuing NVMe reads and writes"),
    Setting("busy_poll_us", "auto", _busy_poll,
            "after each request the socket loop polls, not sleeps, this long (a waiting worker's "
            "next request is read at once; costs up to a core while clients are active); auto: "
            "10000 on hosts of 8 or more usable cores, 1000 below; 0: off", "us"),
    Setting("max_frame", "64MiB", _size, "largest socket frame accepted, and largest reply "
            "(an inline get of more bytes is refused)", "bytes"),
    Setting("max_buffered", "256MiB", _size,
            "socket bytes of partly received frames, all connections together; the connection "
            "that would pass it is closed (a peer sending half frames cannot grow the service "
            "without bound)", "bytes"),
    Setting("max_host_slots", 1 << 20, _int,
            "host slots per namespace (host_capacity / block_bytes) at most: each costs 17 bytes "
            "of metadata at create and every start (block_bytes=1 at 64 MiB asked ~1 GB); "
            "a namespace needing more is refused"),
    Setting("max_slot_metadata", "512MiB", _size,
            "host-slot metadata of all namespaces together (17 bytes a slot; each namespace's "
            "pool spans host_capacity); a namespace that would pass it is refused", "bytes"),
    Setting("max_namespaces", 1000, _int,
            "namespaces per service at most; each costs a memfd, segment files and table "
            "memory (1,000 is also LMDB's ceiling here)"),
    Setting("redis", "", _str, "shared remote tier: a Redis URL, or several comma-separated "
            "(sharded by consistent hashing); empty disables it"),
    Setting("redis_cluster", False, _bool, "the redis URL is a Redis Cluster node"),
    Setting("redis_ttl", 0.0, _float, "TTL of remote blocks; 0 keeps them", "s"),
    Setting("redis_timeout", 2.0, _float, "per-call timeout of the remote tier", "s"),
    Setting("allowed_uids", (), _uids, "uids besides the service's own that may map host memory"),
    Setting("socket_group", "", _str, "group that may use the socket (mode 0660); empty: 0600"),
)

_BY_NAME = {s.name: s for s in SETTINGS}


@dataclass(slots=True, frozen=True)
class Settings:
    """Validated settings. Sizes are bytes, durations seconds."""

    data_dir: str = "./kvtier-data"
    socket: str = ""
    admin: str = "127.0.0.1:8787"
    admin_token: str = ""
    admin_hosts: str = ""
    admin_max_body: int = 64 << 10
    host_capacity: int = 1 << 30
    nvme_capacity: int = 16 << 30
    hbm_capacity: int = 0
    hbm_reserve: str = "fixed"
    hbm_reserve_alpha: float = 0.7
    gpu_copy_engine_bytes: int = 1 << 20
    gpu_onboard_copy_engine_bytes: int = 64 << 10
    gpu_sorted_gets: str = "auto"
    gpu_kernel_blocks: int = 16
    gpu_device_kernel_blocks: int = 0
    gpu_place_blocks: int = 0
    write_policy: str = "write_through"
    eviction: str = "chain"
    eviction_host: str = ""
    eviction_nvme: str = ""
    eviction_hbm: str = ""
    eviction_small: str = ""
    eviction_ghost: str = ""
    eviction_freq_max: str = ""
    eviction_leaf_first: str = ""
    prefetch_blocks: int = 8
    flush_interval: float = 1.0
    checkpoint_interval: float = 1.0
    segment_bytes: int = 256 << 20
    compact_threshold: float = 0.5
    reserve_timeout: float = 30.0
    lease_timeout: float = 600.0
    max_client_share: float = 0.75
    io_threads: int = 4
    busy_poll_us: float = field(default_factory=auto_busy_poll_us)
    max_frame: int = 64 << 20
    max_buffered: int = 256 << 20
    max_host_slots: int = 1 << 20
    max_slot_metadata: int = 512 << 20
    max_namespaces: int = 1000
    redis: str = ""
    redis_cluster: bool = False
    redis_ttl: float = 0.0
    redis_timeout: float = 2.0
    allowed_uids: tuple[int, ...] = field(default_factory=tuple)
    socket_group: str = ""

    def policy_for(self, tier_label: str) -> str:
        chosen = getattr(self, f"eviction_{tier_label}", "") or self.eviction
        return _choice(EVICTION_POLICIES)(chosen, f"eviction_{tier_label}")

    def policy_params(self, tier_label: str) -> dict[str, str]:
        """The eviction_<param> values that apply to one tier (empty ones left out)."""
        out = {}
        for name in POLICY_PARAMETERS:
            value = tier_values(getattr(self, f"eviction_{name}"), f"eviction_{name}").get(
                tier_label, "")
            if value:
                out[name] = value
        return out

    @property
    def socket_path(self) -> Path:
        return Path(self.socket) if self.socket else Path(self.data_dir) / "run" / "kvtier.sock"

    def replace(self, **changes: Any) -> "Settings":
        return make_settings({**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def make_settings(values: dict[str, Any]) -> Settings:
    """Validate raw values (strings from env or TOML, or typed) into Settings."""
    out: dict[str, Any] = {}
    for name, raw in values.items():
        setting = _BY_NAME.get(name)
        if setting is None:
            raise ConfigError(f"unknown setting {name!r}; known: {', '.join(_BY_NAME)}")
        out[name] = setting.parse(raw, name)
    for s in SETTINGS:
        out.setdefault(s.name, s.parse(s.default, s.name))
    for tier in ("host", "nvme", "hbm"):
        if out[f"eviction_{tier}"]:
            _choice(EVICTION_POLICIES)(out[f"eviction_{tier}"], f"eviction_{tier}")
    if out["segment_bytes"] < (1 << 20):
        raise ConfigError("segment_bytes: must be at least 1MiB")
    if out["max_frame"] < 4096:
        raise ConfigError("max_frame: must be at least 4KiB")
    if not 0 < out["max_client_share"] <= 1:
        raise ConfigError("max_client_share: a fraction above 0 and at most 1")
    if out["compact_threshold"] > 1:
        raise ConfigError("compact_threshold: a fraction between 0 and 1")
    if not 0 < out["hbm_reserve_alpha"] < 1:
        raise ConfigError("hbm_reserve_alpha: a fraction strictly between 0 and 1 (0.7: seed "
                          "2.1)")
    if out["gpu_kernel_blocks"] < 1:
        raise ConfigError("gpu_kernel_blocks: must be at least 1")
    if not 1 <= out["max_namespaces"] <= 1000:
        raise ConfigError("max_namespaces: 1 to 1000 (the LMDB catalog's ceiling)")
    if out["max_host_slots"] < 1:
        raise ConfigError("max_host_slots: must be at least 1")
    if out["max_buffered"] < out["max_frame"]:
        raise ConfigError(f"max_buffered ({out['max_buffered']}) must be at least max_frame "
                          f"({out['max_frame']}): one whole frame has to fit")
    if out["io_threads"] < 1:
        raise ConfigError("io_threads: must be at least 1")
    settings = Settings(**out)
    path = os.fsencode(settings.socket_path)
    if len(path) > _SUN_PATH_MAX:
        raise ConfigError(f"socket: {settings.socket_path} is {len(path)} bytes, and a Unix "
                          f"socket path holds at most {_SUN_PATH_MAX}; choose a shorter socket "
                          "(or data_dir, which holds the default socket)")
    return settings


_SUN_PATH_MAX = 107            # sockaddr_un.sun_path is 108 bytes on Linux, with the NUL


def load(config_file: str | None = None, env: dict[str, str] | None = None,
         overrides: dict[str, Any] | None = None) -> Settings:
    """Defaults < TOML file < KVTIER_* environment < explicit overrides (flags)."""
    values: dict[str, Any] = {}
    if config_file:
        path = Path(config_file)
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
        data = data.get("kvtier", data)
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: expected a table of settings")
        values.update({k.replace("-", "_"): v for k, v in data.items()})
    env = os.environ if env is None else env
    for s in SETTINGS:
        key = f"KVTIER_{s.name.upper()}"
        if key in env:
            values[s.name] = env[key]
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return make_settings(values)


def markdown_table() -> str:
    """The README's configuration table, generated from SETTINGS."""
    lines = ["| setting | flag | env | default | unit | meaning |", "|---|---|---|---|---|---|"]
    for s in SETTINGS:
        default = s.default if s.default not in ("", ()) else "(empty)"
        lines.append(f"| `{s.name}` | `--{s.name.replace('_', '-')}` | `KVTIER_{s.name.upper()}` "
                     f"| `{default}` | {s.unit} | {s.help} |")
    return "\n".join(lines)
