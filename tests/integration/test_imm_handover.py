"""Zero-downtime DP1 -> DP2 switchover with request handover (tiny Qwen3-MoE, 2 logical
devices, float32): while an active dp=1 instance streams three requests (greedy of
different lengths + one seeded sampled), the HMM stages the DP2 layout, a dp=2 instance
attaches to the pending handle sets and warms up, the old instance pauses and exports,
the new one imports (device 0's requests keep their KV: no recomputation), the old retires
and the HMM commits. Every spliced stream equals the run without scaling, with no
repeated or missing delta."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch
from ray_hmm import ray_hmm

from elasticmoe.config import EngineConfig, EngineOptions
from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.outputs import RequestOutput
from elasticmoe.sampling_params import SamplingParams
from hmm.planner import scale_target
from imm.handover import HandedOverOutput, RankPaused, spliced_stream
from imm.instance import Instance
from imm.lifecycle import InstanceState

pytestmark = pytest.mark.slow

BUDGET, KV, PAGE = 32 << 20, 4 << 20, 4096
OPTIONS = EngineOptions(dtype=torch.float32, num_threads=1)
# Long enough to still run when the switch happens, 512 B of KV a token. The ranks step at most 50
# times a second (`paced_engines`): unpaced, ~216 tokens were out at the pause after a 0.44 s
# staging, and a clean-clone run beside the other test worker once generated 628 while the new
# instance was staged and warmed up (the 600-token request had finished before the pause); paced,
# ~20 are out, and the staging would have to take 6.4 s to finish the shortest request.
REQUESTS = {
    "greedy-long": ([5, 6, 7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)),
    "greedy-short": ([11, 12, 13], SamplingParams(temperature=0.0, max_tokens=320, ignore_eos=True)),
    "sampled": ([20, 21, 22, 23], SamplingParams(temperature=0.8, seed=7, max_tokens=360, ignore_eos=True)),
}


@pytest.fixture(scope="module")
def hmm(tiny_model_dir, paced_engines):
    with ray_hmm(tiny_model_dir, dp=1, budget=BUDGET, kv_bytes=KV, page=PAGE) as ctl:
        yield ctl


def _reference(model_dir: str) -> dict[str, RequestOutput]:
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=512, num_threads=1))
    for rid, (prompt, params) in REQUESTS.items():
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return final


def test_switchover_hands_running_requests_to_the_new_instance(hmm, tiny_model_dir):
    old = Instance.create_standby(tiny_model_dir, dp=1, engine_options=OPTIONS)
    new = Instance.create_standby(tiny_model_dir, dp=2, engine_options=OPTIONS)  # pre-initialised
    try:
        old.attach(hmm)
        old.warm_up()
        old.activate()
        items: dict[str, list[RequestOutput | HandedOverOutput]] = {rid: [] for rid in REQUESTS}
        started = threading.Barrier(len(REQUESTS) + 1)

        def consume(rid: str) -> None:
            prompt, params = REQUESTS[rid]
            for item in spliced_stream(old.ranks[0].generate.remote(EngineRequest(rid, prompt, params))):
                items[rid].append(item)
                if len(items[rid]) == 3:
                    started.wait(timeout=60)

        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            futures = [pool.submit(consume, rid) for rid in REQUESTS]
            started.wait(timeout=60)  # every stream is generating
            t_scale = time.perf_counter()
            target = scale_target(hmm.layout, 2, [hmm.devices[1]], kv_bytes=KV)
            hmm.execute(hmm.plan(target))
            new.attach(hmm, pending=True, fenced_device_ids=old.device_ids)
            new.warm_up()
            t_pause = time.perf_counter()
            old.pause()
            snaps = old.export_requests(hand_over_kv=True)
            # A request Ray starts on the old rank only now (sent before the pause, started after)
            # is turned away unstreamed, for the coordinator to route again; not failed, not lost.
            late = old.ranks[0].generate.remote(EngineRequest("late", [1, 2, 3], REQUESTS[next(iter(REQUESTS))][1]))
            with pytest.raises(RankPaused):
                ray.get(next(late))
            assert old.route_handed_over(new.import_requests(snaps)) == len(REQUESTS)
            t_imported = time.perf_counter()
            new.activate()
            assert new.wait_resumed(list(REQUESTS), 60) == set()  # every consumer followed its marker
            old.retire()
            hmm.commit()
            t_done = time.perf_counter()
            for f in futures:
                f.result(timeout=120)

        # Every request was mid-generation at the pause and went to rank 0 (device 0, kept).
        assert sorted(s.request_id for s in snaps[0]) == sorted(REQUESTS)
        assert all(0 < len(s.token_ids) - s.num_prompt_tokens < REQUESTS[s.request_id][1].max_tokens for s in snaps[0])
        (report,) = [r for r in new.import_reports if r.num_requests]  # rank 1 got an empty import
        assert report.rank == 0 and report.kv_is_shared and report.num_requests == 3
        by_id = {s.request_id: s for s in snaps[0]}
        for rid, computed in report.num_computed_tokens.items():
            assert computed == by_id[rid].num_computed_tokens > 0, rid  # KV kept, nothing recomputed

        reference = _reference(tiny_model_dir)
        for rid, stream in items.items():
            markers = [i for i in stream if isinstance(i, HandedOverOutput)]
            outs = [i for i in stream if isinstance(i, RequestOutput)]
            assert len(markers) == 1 and not outs[-2 if outs[-1].finished else -1].finished
            assert outs[-1].finished and outs[-1].finish_reason == "length"
            assert [t for o in outs for t in o.new_token_ids] == outs[-1].output_token_ids  # no dup, no gap
            assert "".join(o.new_text for o in outs) == outs[-1].text
            assert outs[-1].output_token_ids == reference[rid].output_token_ids, rid
            assert outs[-1].text == reference[rid].text
        assert old.state is InstanceState.RETIRED and new.state is InstanceState.ACTIVE
        stats = new.stats()
        assert all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats)  # all blocks came back
        print(
            f"\nscale DP1->DP2 {t_done - t_scale:.3f}s; critical section (pause -> import done) "
            f"{(t_imported - t_pause) * 1e3:.1f} ms; tokens out at the pause "
            f"{ {s.request_id: len(s.token_ids) - s.num_prompt_tokens for s in snaps[0]} }"
        )
    finally:
        for inst in (old, new):
            if inst.state is not InstanceState.RETIRED:
                inst.retire()
