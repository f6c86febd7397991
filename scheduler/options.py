"""The scheduler's options: where it listens, its run directory, its heartbeat and timeouts,
its checkpoints and security (from its flags, scheduler/__main__.py)."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SchedulerOptions:
    host: str = "127.0.0.1"
    port: int = 0
    run_dir: str = "runs/run"
    heartbeat_s: float = 1.0
    dead_after_s: float = 30.0
    register_timeout_s: float = 300.0
    stall_timeout_s: float = 300.0
    server_timeout_s: float = 120.0
    checkpoint_every: int = 0  # steps (BSP) or reported updates (ASP/SSP) between checkpoints; 0: none
    keys: object = None  # omnips.security.Keys: CURVE on every connection, clients from the allow-list only
    token: str = field(default="", repr=False)
    transport: str = "auto"  # how to reach servers on this host: auto (ipc) or tcp (omnips.routes)
    status_host: str = "127.0.0.1"
    status_port: int | None = None  # the status server's (0: any free one); None: none
