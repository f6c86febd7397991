"""A worker's settings, from its command line (parsed without importing torch)."""

from dataclasses import dataclass, field

from omnips import security

from .emulation import Emulation


@dataclass(frozen=True)
class WorkerOptions:
    scheduler: str
    device: str = "auto"
    threads: int = 0
    capacity: float = 1.0
    rank: int = -1
    max_batch: int = 0
    memory_limit: int = 0  # bytes; 0: what the device has free
    fault_oom_above: int = 0
    fault_nan_at: frozenset = frozenset()  # test knob: steps whose gradient is made NaN
    emulation: Emulation = Emulation()
    ack_timeout_s: float = 10.0
    welcome_timeout_s: float = 300.0
    server_timeout_s: float = 120.0
    keys: security.Keys | None = None
    token: str = field(default="", repr=False)
    bucket_bytes: int = 4 << 20  # the gradient leaves in buckets of this size while backward runs; 0: after it
    transport: str = "auto"  # how to reach servers on this host: auto (ipc) or tcp (omnips.routes)
    log_level: str = "INFO"
