"""benchmarks/pushpull.py's tables: each configuration's round trip against raw ZeroMQ's taken
alongside, the CPU each process spent, CURVE's cost, the floors and the in-process pieces."""

import os
import statistics

import numpy as np
import zmq
from baselines import TRANSPORTS

TARGET_RATIO = 1.15


# -- report ------------------------------------------------------------------------
def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def summarize(results: list[dict], gl: dict) -> list[dict]:
    gloo_med = statistics.median(gl["times"])
    rows = []
    for r in results:
        om, raw = statistics.median(r["omni"]), statistics.median(r["raw"])
        rows.append({
            "config": r["config"], "plain": r["plain"], "kind": r["kind"], "curve": r["curve"], "median": om,
            "p10": float(np.percentile(r["omni"], 10)), "p90": float(np.percentile(r["omni"], 90)), "raw": raw,
            "ratio": om / raw, "copy": statistics.median(r["copy"]),
            # per-pair ratio: each omnips round trip over the raw one taken next to it
            "pair_ratio": statistics.median(o / w for o, w in zip(r["omni"], r["raw"])),
            # fastest over fastest: the least disturbed by other load on the machine
            "min_ratio": min(r["omni"]) / min(r["raw"]),
            "gloo_ratio": om / gloo_med,
            # each over the raw ZeroMQ round trips of its own window: cancels load drift between the two
            "gloo_adjusted": (om / raw) / (gloo_med / statistics.median(gl[r["kind"]])),
            "cpu": r["cpu"], "raw_cpu": r["raw_cpu"],
        })
    return rows


def cpu_section(rows: list[dict]) -> list[str]:
    """CPU time per round trip, omnips against raw ZeroMQ: on a machine whose cores the raw
    round trip already keeps busy, omnips's extra work adds to the wall time instead of
    overlapping the transfer."""
    cores = os.cpu_count()
    lines = ["", "## CPU per round trip (every process of each side, every thread)", "",
             "| configuration | omnips CPU ms | its ZeroMQ I/O threads | its other threads | omnips cores busy "
             "| raw ZeroMQ CPU ms | its ZeroMQ I/O threads | raw cores busy | omnips CPU over raw's, ms "
             f"| omnips CPU / {cores} cores, over raw's wall |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        (split, wall), (raw_split, raw_wall) = r["cpu"], r["raw_cpu"]
        cpu, raw_cpu = split.sum(), raw_split.sum()
        lines.append(f"| {r['config']} | {ms(cpu)} | {ms(split[0])} | {ms(split[1])} | {cpu / wall:.2f} "
                     f"| {ms(raw_cpu)} | {ms(raw_split[0])} | {raw_cpu / raw_wall:.2f} "
                     f"| {ms(cpu - raw_cpu)} | {cpu / cores / raw_wall:.2f}x |")
    lines += ["", "Each configuration measured over as many round trips as it timed, right after them, first "
              "omnips's (this process, the scheduler and the servers: utime + stime from /proc) and then raw "
              "ZeroMQ's (this process and its peer), not interleaved. ZeroMQ's I/O threads move the bytes "
              "(the raw round trip's whole work); the other threads are the processes' own: omnips's main "
              "threads check, update and copy. Cores busy: CPU "
              "time over wall time. The last column is a floor: a round trip can not take less wall time than "
              f"its CPU time spread over all {cores} cores, so it is the least omnips / raw ratio this much work "
              "allows on this machine, however well it overlaps the transfer."]
    return lines


def curve_section(rows: list[dict], nbytes: int) -> list[str]:
    """CURVE on vs off for each configuration measured both ways (each run right after the other)."""
    plain = {r["config"]: r for r in rows if not r["curve"]}
    pairs = [(plain[r["plain"]], r) for r in rows if r["curve"] and r["plain"] in plain]
    if not pairs:
        return []
    lines = ["", "## CURVE on vs off (every process on --keys: encrypted, authenticated connections)", "",
             "| configuration | off ms | on ms | on / off | on / off, each over its raw | off GB/s | on GB/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for off, on in pairs:
        lines.append(f"| {off['config']} | {ms(off['median'])} | {ms(on['median'])} "
                     f"| {on['median'] / off['median']:.2f}x | {on['ratio'] / off['ratio']:.2f}x "
                     f"| {2 * nbytes / off['median'] / 1e9:.2f} | {2 * nbytes / on['median'] / 1e9:.2f} |")
    lines += ["", "GB/s: bytes pushed plus bytes pulled per second of round trip. The second ratio divides each "
              "configuration by the raw round trips interleaved with it, cancelling drift between the two runs."]
    return lines


def _spread(times: list[float]) -> str:
    return f"{ms(statistics.median(times))} | {ms(np.percentile(times, 10))} | {ms(np.percentile(times, 90))}"


def _faster(*ratios: float) -> str:
    return "yes" if all(x < 1 for x in ratios) else "no" if all(x >= 1 for x in ratios) else "within noise"


def render(rows, raw_by_kind, floor_rows, gl, piece_times, args, n, total_s) -> list[str]:
    from report import machine_lines

    from omnips.protocol import MAX_PARTS

    nbytes = 4 * n
    gloo_t = gl["times"]
    gloo_med = statistics.median(gloo_t)
    lines = [
        "# omnips fused push-pull vs raw ZeroMQ, raw sockets and gloo all_reduce",
        "",
        *machine_lines(),
        f"- pyzmq {zmq.__version__} / libzmq {zmq.zmq_version()}, numpy {np.__version__}, "
        f"torch {__import__('torch').__version__}",
        f"- vector: {n:,} float32 = {nbytes:,} bytes ({nbytes / 2**20:.1f} MiB) each way; {args.repeats} timed "
        f"round trips after {args.warmup} warm-ups per configuration ({args.curve_repeats} with CURVE); loopback",
        "- raw ZeroMQ: DEALER -> ROUTER in a child process, header + zero-copy vector frame each way, preallocated "
        "page-aligned buffers, MALLOC_ENV in both processes; no computation; tcp and ipc (unix socket)",
        "- omnips: real scheduler + server processes, this process as the only worker "
        + (f"(pushes in buckets of {args.bucket_size:,} bytes (more where a shard would be in more than "
           f"{MAX_PARTS} parts, as a worker's plan raises them), last values first, and the reply in parts of the same "
           "size, as a worker sends while backward runs; server checks each part as it comes, joins them, takes the "
           "SGD-momentum step range by range, sending each reply part once its range is updated; each reply part "
           "copied into params as it arrives), " if args.bucket_size else
           "(ServerGroup.push_pull: push gradients, server checks + SGD-momentum step, reply copied into params), ")
        + f"servers with --threads {args.server_threads}; raw ZeroMQ round trips of the same transport interleaved "
        "with omnips ones while each cluster runs",
        *(["- CURVE: each tcp configuration again right after it, every process (this one too) on --keys"]
          if any(r["curve"] for r in rows) else []),
        "- raw socket: Python socket echo (sendall, recv_into a preallocated page-aligned buffer, the same bytes "
        "back), interleaved with raw ZeroMQ round trips of the same transport",
        "- gloo: torch.distributed all_reduce of the same float32 vector, 2 processes, 1 torch thread each, "
        "127.0.0.1 (GLOO_SOCKET_IFNAME=lo), a barrier before each; rank 0's times; raw ZeroMQ round trips "
        "(tcp, ipc) alternate with the all_reduces",
        f"- targets: omnips / raw ZeroMQ <= {TARGET_RATIO} (median ratio, tcp and ipc apart; plain, not CURVE), "
        "and omnips faster than gloo all_reduce of the same bytes (judged on the medians as measured and on "
        "each over the raw ZeroMQ round trips of its own window; \"within noise\" when the two disagree)",
        f"- load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; the 2 cores are shared with "
        "other users' processes, which inflate omnips (which computes) more than the raw baselines",
        "",
        "## Baselines (communication only)",
        "",
        "| baseline | median ms | p10 ms | p90 ms | GB/s both ways | raw ZeroMQ alongside, median ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind in TRANSPORTS:
        t = raw_by_kind[kind]
        lines.append(f"| raw ZeroMQ request-reply, {kind} (every omnips window) | {_spread(t)} "
                     f"| {2 * nbytes / statistics.median(t) / 1e9:.2f} | |")
    for f in floor_rows:
        lines.append(f"| {f['name']} | {_spread(f['times'])} | {2 * nbytes / statistics.median(f['times']) / 1e9:.2f} "
                     f"| {ms(statistics.median(f['zmq']))} |")
    lines.append(f"| gloo all_reduce, 2 ranks | {_spread(gloo_t)} | {2 * nbytes / gloo_med / 1e9:.2f} | "
                 + ", ".join(f"{kind} {ms(statistics.median(gl[kind]))}" for kind in TRANSPORTS) + " |")
    lines += ["", "GB/s for gloo: the vector's bytes in and out of a rank per second, as for a round trip "
              "(a 2-rank ring moves half the vector each way twice).", "",
              "## omnips", "",
              "| configuration | median ms | p10 ms | p90 ms | raw ZeroMQ median ms (same window, same transport) "
              "| omnips / raw | median of per-pair ratios | min / min | worker reply copy ms "
              f"| <= {TARGET_RATIO}x raw | omnips / gloo | the same, each over its raw | faster than gloo |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        verdict = "-" if r["curve"] else "yes" if r["ratio"] <= TARGET_RATIO else "no"
        lines.append(f"| {r['config']} | {ms(r['median'])} | {ms(r['p10'])} | {ms(r['p90'])} | {ms(r['raw'])} "
                     f"| {r['ratio']:.2f}x | {r['pair_ratio']:.2f}x | {r['min_ratio']:.2f}x | {ms(r['copy'])} "
                     f"| {verdict} | {r['gloo_ratio']:.2f}x | {r['gloo_adjusted']:.2f}x "
                     f"| {'-' if r['curve'] else _faster(r['gloo_ratio'], r['gloo_adjusted'])} |")
    lines += cpu_section(rows)
    lines += curve_section(rows, nbytes)
    lines += ["", "## Where the time goes (in-process pieces, medians, run after the clusters)", "",
              "| piece | ms |", "|---|---:|"]
    for name, t in piece_times.items():
        lines.append(f"| {name} | {ms(t)} |")
    copy = piece_times["worker: np.copyto of the reply into params"]
    for kind in TRANSPORTS:
        raw_med = statistics.median(raw_by_kind[kind])
        for mode in ("ASP", "BSP"):
            handle = piece_times[f"server: ShardCore.handle(Push), {mode} (check + update)"]
            est = raw_med + copy + handle
            measured = [r["median"] for r in rows if r["config"] == f"omnips {mode}, 1 server, {kind}"]
            tail = f"; measured {ms(measured[0])} ms" if measured else ""
            lines += ["", f"{mode} 1 server over {kind}, sum of the pieces if nothing overlapped: raw {ms(raw_med)} "
                      f"+ reply copy {ms(copy)} + server handle {ms(handle)} = {ms(est)} ms ({est / raw_med:.2f}x raw)"
                      f"{tail}. Within {TARGET_RATIO}x the worker copy and the server's check and update together "
                      f"would have to fit in {ms((TARGET_RATIO - 1) * raw_med)} ms."]
    lines += ["", "(Pieces timed in this process at another moment: a rough guide only.)", "",
              f"Total benchmark time: {total_s:.0f} s."]
    return lines
