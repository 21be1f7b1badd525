"""Whether paged decode and the kv_cache kernels keep enough loads in flight to saturate HBM
(modelled: Little's law at an assumed loaded DRAM latency)."""
from __future__ import annotations

import math
from typing import List, Tuple

from .cuda import _file_constant
from .h100 import H100, KV_CACHE_SHAPES, PAGED_BATCH, PAGED_CTX, PAGED_WINDOW, ROOT
from .roofline import roofline_cases


# Loaded DRAM latency assumed for the H100 SXM5: the time from a global load's issue to its data
# while HBM is busy (an assumption, not measured here). Pointer-chasing microbenchmarks measure
# the *unloaded* latency, which is lower; queueing at high bandwidth adds to it, and 600-800 ns is
# the range commonly used for the loaded figure: 700 ns is its middle. Every "needed" figure
# scales linearly with it; the report also gives each launch's break-even latency.
DRAM_LATENCY_NS = 700.0
TARGET_PCT = 85.0  # target: paged decode and rerotate/copy_kv must predict >= 85% of 3.35 TB/s
# Dependent global round trips before a CTA's first main-loop load (counted from the kernel source):
PROLOGUE_ROUND_TRIPS = {
    "paged": 4,  # tile map -> sequence bounds and kv_len -> q_pos -> page index -> first K tile
    "rerotate": 3,  # delta -> inv_freq (cos/sin staging, barrier) -> rows -> row data
    "copy_rotate": 3,  # delta -> inv_freq (barrier) -> src/dst rows -> row data
    "copy": 1,  # src/dst rows -> row data
    "merge": 0,  # every load of the program is independent
}


def bytes_in_flight_needed(read_fraction: float = 1.0, latency_ns: float = DRAM_LATENCY_NS) -> float:
    """Bytes of loads one SM must keep in flight for the whole H100 to move 3.35 TB/s (Little's law:
    bandwidth x latency / SMs). Stores are posted (nothing waits for them), so a launch whose
    traffic is ``read_fraction`` reads needs only that share of it as loads in flight."""
    return H100["hbm_bytes_per_s"] * latency_ns * 1e-9 * read_fraction / H100["sms"]


def launch_bandwidth(grid_ctas: int, ctas_per_sm: int, inflight_per_cta: float, read_fraction: float,
                     latency_ns: float = DRAM_LATENCY_NS) -> dict:
    """Modelled DRAM bandwidth of a launch of equal CTAs (Little's law, wave by wave).

    ``inflight_per_cta``: bytes of loads a CTA keeps in flight on average (per main-loop trip x the
    share of its round trips that are main-loop trips). Full waves hold ``ctas_per_sm`` x 132 CTAs,
    the tail the rest; a wave of n CTAs moves min(3.35 TB/s, n x inflight / latency / read_fraction),
    and each CTA moves the same bytes, so time is sum over waves of n / rate.
    """
    sms, peak = H100["sms"], H100["hbm_bytes_per_s"]
    slots = ctas_per_sm * sms
    full, tail = divmod(grid_ctas, slots)
    lat = latency_ns * 1e-9

    def rate(n):
        return min(peak, n * inflight_per_cta / (lat * read_fraction))

    time = full * slots / rate(slots) + (tail / rate(tail) if tail else 0.0)
    bw = grid_ctas / time
    per_sm = min(grid_ctas, slots) / min(grid_ctas, sms) * inflight_per_cta  # the first wave's
    return dict(grid_ctas=grid_ctas, ctas_per_sm=ctas_per_sm, waves=round(grid_ctas / slots, 2), tail_ctas=tail,
                tail_sms=min(tail, sms), inflight_per_sm=round(per_sm), needed_per_sm=round(bytes_in_flight_needed(read_fraction, latency_ns)),
                # the latency at which the first wave would fall to the target (the assumption's margin)
                latency_at_target_ns=round(min(grid_ctas, slots) * inflight_per_cta / (TARGET_PCT / 100 * peak * read_fraction) * 1e9),
                tbps=round(bw / 1e12, 3), pct=round(100 * bw / peak, 1))


def kv_cache_row_loops(kind: str, layers: int, heads: int, head_dim: int, rotary_dim: int, elt: int) -> List[Tuple[int, int]]:
    """The load loops of one CTA of the kv_cache kernels (one row, every layer), in code order, NeoX
    layout with 16-byte slots, mirroring csrc/kv_cache/kv_cache_kernels.cu: [(slots, bytes per slot)].
    Each trip of a loop issues kBatch slots per thread before any of their stores."""
    vec = 16 // elt
    if kind == "rerotate":
        return [(layers * heads * (rotary_dim // 2) // vec, 32)]  # rotate_slots: a slot and its NeoX partner
    v_row = (layers * heads * head_dim // vec, 16)  # copy_units: the V row
    if kind == "copy":
        return [(layers * heads * head_dim // vec, 16), v_row]  # copy_units: the K row
    # copy_kv_ with rotation: rotate_slots, copy_units of the unrotated dims, the V row
    return [(layers * heads * (rotary_dim // 2) // vec, 32), (layers * heads * (head_dim - rotary_dim) // vec, 16), v_row]


def _row_trips_bytes(loops: List[Tuple[int, int]], threads: int, batch: int) -> Tuple[int, int]:
    """(main-loop trips, bytes read) of one CTA running ``loops``."""
    return sum(math.ceil(n / (batch * threads)) for n, _ in loops), sum(n * b for n, b in loops)


def bandwidth_cases(triton_rows: List[dict], cuda_rows: List[dict]) -> List[dict]:
    """The Little's-law model of paged decode (split-KV kernel + its merge) and of rerotate_keys_ /
    copy_kv_ at the benchmarks' GPU shapes, from the compiled rows (CTAs/SM; for Triton the bytes
    in flight read from the TTGIR). Cases whose kernels are not among the rows are left out.

    Each launch gets ``launch_bandwidth``; a case's predicted bandwidth is its compulsory bytes
    (the roofline's) over the sum of its launches' modelled times, as % of 3.35 TB/s.
    """
    H, Hkv, D, bf = 32, 8, 128, 2
    compulsory = {c["case"]: c["bytes"] for c in roofline_cases()}
    out = []

    def case(name, launches):
        for ln in launches:
            ln.update(launch_bandwidth(ln["grid_ctas"], ln["ctas_per_sm"], ln["inflight_per_cta"],
                                       ln["read_bytes"] / ln["traffic_bytes"]))
            ln["time_us"] = ln["traffic_bytes"] / (ln["tbps"] * 1e12) * 1e6
        t = sum(ln["time_us"] for ln in launches)
        bw = compulsory[name] / (t * 1e-6)
        out.append(dict(case=name, launches=launches, time_us=round(t, 2), tbps=round(bw / 1e12, 3),
                        pct=round(100 * bw / H100["hbm_bytes_per_s"], 1)))

    for tag, window in (("decode", -1), ("decode_window", PAGED_WINDOW)):
        name = f"paged_attention/{tag}"
        rows = {r["kernel"].split(".")[-1]: r for r in triton_rows if r["case"] == name}
        k = rows.get("_paged_attention_kernel")
        if k is None:
            continue
        tiles, kv_heads, splits = k["grid"]
        span = PAGED_CTX if window < 0 else min(PAGED_CTX, window + 1)
        keys = span / splits  # per program (the last split is shorter)
        trips = keys / k["constexprs"]["BLOCK_N"]
        duty = trips / (trips + PROLOGUE_ROUND_TRIPS["paged"])
        q_bytes = PAGED_BATCH * H * D * bf
        kv_read = PAGED_BATCH * span * kv_heads * D * bf * 2
        part_out = splits * PAGED_BATCH * H * (D * 4 + 4) if splits > 1 else PAGED_BATCH * H * (D * bf + 4)
        launches = [dict(kernel=k["kernel"], grid_ctas=tiles * kv_heads * splits, ctas_per_sm=k["ctas_per_sm"],
                         inflight_per_trip=k["pipeline"]["inflight_bytes"], trips=round(trips, 1),
                         prologue_round_trips=PROLOGUE_ROUND_TRIPS["paged"],
                         inflight_per_cta=k["pipeline"]["inflight_bytes"] * duty,
                         inflight_source="TTGIR: " + ", ".join(
                             [f"cp.async buffers {s} {t}" for s, t, _ in k["pipeline"]["async_buffers"]]
                             + [f"loop load {s} {t}" for s, t, _ in k["pipeline"]["loop_loads"]]),
                         nominal_inflight_per_trip=(k["num_stages"] - 1) * 2 * k["constexprs"]["BLOCK_N"] * D * bf,
                         read_bytes=kv_read + q_bytes, traffic_bytes=kv_read + q_bytes + part_out)]
        m = rows.get("_merge_split_kernel")
        if splits > 1:
            if m is None:
                continue
            per_row = splits * H * (D * 4 + 4)  # one program per query row reads every split's partials at once
            launches.append(dict(kernel=m["kernel"], grid_ctas=m["grid"][0], ctas_per_sm=m["ctas_per_sm"],
                                 inflight_per_trip=per_row, trips=1, prologue_round_trips=PROLOGUE_ROUND_TRIPS["merge"],
                                 inflight_per_cta=per_row, inflight_source="source: all partials of a row in one load",
                                 nominal_inflight_per_trip=per_row, read_bytes=part_out,
                                 traffic_bytes=part_out + PAGED_BATCH * H * (D * bf + 4)))
        case(name, launches)

    kv_rows = [r for r in cuda_rows if "kv_cache" in r["file"]]
    kv_cu = ROOT / "csrc" / "kv_cache" / "kv_cache_kernels.cu"
    batch = _file_constant(kv_cu, "kBatch")
    # the benchmark's configuration: bf16 (16-byte slots: VEC 8), NeoX, rotary_dim = head_dim
    for kind, bench, instance in (("rerotate", "rerotate_keys_", "rerotate_keys_kernel<__nv_bfloat16, 8, false>"),
                                  ("copy", "copy_kv_", "copy_kv_kernel<__nv_bfloat16, __nv_bfloat16, 8, false, false>"),
                                  ("copy_rotate", "copy_kv_+rotate", "copy_kv_kernel<__nv_bfloat16, __nv_bfloat16, 8, false, true>")):
        row = next((r for r in kv_rows if instance in r["kernel"]), None)
        if row is None:
            continue
        for tag, layers, n in KV_CACHE_SHAPES:
            loops = kv_cache_row_loops(kind, layers, Hkv, D, D, bf)
            trips, read = _row_trips_bytes(loops, row["threads"], batch)
            pro = PROLOGUE_ROUND_TRIPS[kind]
            case(f"kv_cache/{bench} {tag}", [dict(
                kernel=instance, grid_ctas=n, ctas_per_sm=row["ctas_per_sm"], inflight_per_trip=round(read / trips),
                trips=trips, prologue_round_trips=pro, inflight_per_cta=read / (trips + pro),
                inflight_source=f"kBatch {batch} x {row['threads']} threads x 16 B slots (x2 rotated) per trip; "
                                f"PTX: runs of {row.get('load16_runs')} 16-byte loads per thread before their stores",
                nominal_inflight_per_trip=round(read / trips), read_bytes=n * read, traffic_bytes=2 * n * read)])
    return out

