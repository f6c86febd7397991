"""python -m omnips.server: one parameter server (a shard of the model and its optimizer state)."""

import argparse
import logging
import signal
import sys

from omnips import logs, transport
from omnips.flags import add_log_level, add_security, parse_args, port, seconds
from omnips.job import PREEMPTED_EXIT
from omnips.leaving import Leaving


def parse(argv):
    p = argparse.ArgumentParser(allow_abbrev=False, prog="omnips-server", description=__doc__)
    p.add_argument("--scheduler", required=True, help="the scheduler's address, tcp://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=port, default=0, help="port to bind; 0 picks a free one")
    p.add_argument("--rank", type=int, default=-1,
                   help="ask for this server rank (its shard); default: the next free one")
    p.add_argument("--advertise", default=None, help="host name workers use to reach this server")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for the optimizer update (default 1: it is memory-bound, and a "
                        "second thread competes with ZeroMQ's I/O thread and with workers on the same host)")
    p.add_argument("--ack-timeout", type=seconds, default=10.0, help="seconds to wait for the scheduler to answer")
    p.add_argument("--welcome-timeout", type=seconds, default=300.0, help="seconds to wait for the cluster to form")
    add_security(p, listens=True)
    add_log_level(p)
    args = parse_args(p, argv)
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.rank < -1:
        p.error("--rank must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    logs.setup("server", args.log_level)
    import torch  # once the flags are known good: it takes seconds

    from omnips.link import LinkError, Preempted
    from .service import serve
    torch.set_num_threads(args.threads)
    transport.tune_malloc()
    # SIGTERM preempts the job (the shard cannot leave it); a second one ends the server at once,
    # through `finally`: it removes the ipc socket
    leaving = Leaving().install(signal.SIGTERM)
    try:
        return serve(args.scheduler, args.host, args.port, args.advertise, args.ack_timeout, args.welcome_timeout,
                     args.keys, args.token, args.rank, leaving)
    except Preempted as exc:
        logging.getLogger("omnips.server").warning("%s", exc)
        return PREEMPTED_EXIT
    except (LinkError, transport.TransportError, ValueError) as exc:
        logging.getLogger("omnips.server").error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
