"""The prefix-affine replica choice (generate/routing.py): affinity, a new group placed by its shared preamble,
smg's spill gate, dead and restarted replicas, and the client's request body (routed_dp_rank, return_prompt_token_ids, require_reasoning)."""

from __future__ import annotations

import asyncio
import contextlib
import math
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest
from aiohttp import web

from tokenmill_runner.generate.client import GenerateClient, PromptIds
from tokenmill_runner.generate.replica_health import HealthPolicy, ReplicaSet
from tokenmill_runner.generate.results import GenerationFailure
from tokenmill_runner.generate.routing import (
    BLOCK,
    MAX_PREFIX_BLOCKS,
    PrefixAffinity,
    PrefixRecord,
    SpillGate,
    dp_rank,
    prefix_hashes,
)

A, B, C, D = "http://a", "http://b", "http://c", "http://d"


class Fleet:
    """Four replicas with the client's outstanding counts, routed like GenerateClient._choose."""

    def __init__(self, urls: tuple[str, ...] = (A, B, C, D), gate: SpillGate | None = None) -> None:
        self.replicas = ReplicaSet(list(urls), HealthPolicy(open_after=1))
        self.load = dict.fromkeys(urls, 0)
        self.affinity = PrefixAffinity(gate)

    def route(self, key: object, avoid: str | None = None) -> str:
        return self.affinity.choose(key, self.replicas.candidates(avoid), self.load, self.replicas.epochs(),
                                    lambda among: self.replicas.least_loaded(among, self.load))

    def send(self, key: object) -> str:
        url = self.route(key)
        self.load[url] += 1
        return url

    def kill(self, url: str) -> None:
        self.replicas.record_failure(url, 0.0, "refused", True, 0.5)

    def revive(self, url: str) -> None:
        assert self.replicas.record_probe(url, 10.0, True, "/health: 200", 0.5)


def test_the_samples_of_a_prompt_stay_on_the_replica_that_served_the_first():
    fleet = Fleet()
    first = [fleet.send(("d", line)) for line in range(4)]
    assert sorted(first) == [A, B, C, D]  # new groups spread, least loaded first
    again = [fleet.send(("d", line)) for line in range(4) for _ in range(3)]
    assert again == [first[line] for line in range(4) for _ in range(3)]


def test_least_loaded_routing_without_affinity_scatters_a_prompts_samples():
    """What the client did before (and does for requests without a key): each sample to the least-loaded replica."""
    fleet = Fleet()
    chosen = []
    for _ in range(4):
        url = fleet.replicas.pick(fleet.load)
        assert url is not None
        fleet.load[url] += 1
        chosen.append(url)
    assert sorted(chosen) == [A, B, C, D]


def test_the_spill_gate_is_smgs_rule():
    gate = SpillGate()  # smg 1.13.0 defaults: 64 requests, 1.5 x the mean
    assert gate.margin(16.0) == 8.0  # two standard deviations of a Poisson count at mean 16
    assert gate.margin(1.0) == 4.0  # never under four
    assert gate.margin(10_000.0) == 64.0  # capped by the threshold
    assert SpillGate(abs_threshold=2).margin(16.0) == 2.0  # unless the threshold is lower
    assert not gate.overloaded(24, 16.0) and gate.overloaded(25, 16.0)  # both parts: > 16 + 8 and > 24
    assert gate.overloaded(7, 2.0) and not gate.overloaded(6, 2.0)  # at a small mean the margin is four
    assert not SpillGate(rel_threshold=4.0).overloaded(7, 2.0)  # 7 is under 4 x the mean
    with pytest.raises(ValueError, match="rel_threshold"):
        SpillGate(rel_threshold=0.5)
    with pytest.raises(ValueError, match="rel_threshold"):
        SpillGate(rel_threshold=math.inf)


def test_a_holder_loaded_past_the_gate_spills_to_the_least_loaded_which_then_holds_the_prefix_too():
    fleet = Fleet()
    home = fleet.send("g")
    fleet.load[home] = 40  # the others idle: the mean is 10, 40 > 10 + 6.3 and > 15
    spilled = fleet.route("g")
    assert spilled != home and fleet.affinity.spills == 1
    fleet.load[spilled] += 1
    fleet.load[home] = 0  # the first holder recovered: it is a holder still, and now the less loaded one
    assert fleet.route("g") == home
    fleet.load[home] = 5
    assert fleet.route("g") == spilled  # two holders: the less loaded of them


def test_a_holder_within_the_bound_keeps_its_group_even_when_others_are_idler():
    fleet = Fleet()
    home = fleet.send("g")
    fleet.load[home] = 5  # the mean is 1.25: 5 is not past 1.25 + 4
    assert fleet.route("g") == home


def test_when_the_holder_is_dead_the_work_moves_and_a_restarted_replica_is_not_trusted_with_the_prefix():
    fleet = Fleet()
    home = fleet.send("g")
    fleet.kill(home)
    moved = fleet.route("g")
    assert moved != home
    fleet.load[moved] += 1
    fleet.revive(home)
    fleet.load[moved] = 0
    fleet.load[home] = 0
    # Both live and idle; the restarted one lost its cache (its epoch changed), so the group stays where it moved.
    assert fleet.route("g") == moved
    fleet.kill(moved)
    assert fleet.route("g") != moved


def test_a_retry_avoids_the_replica_that_failed_while_another_is_live():
    fleet = Fleet((A, B))
    home = fleet.send("g")
    assert fleet.route("g", avoid=home) != home


def test_groups_are_forgotten_oldest_first_past_the_bound():
    affinity = PrefixAffinity(max_groups=2)
    pick = {"n": 0}

    def rotate(among):
        pick["n"] += 1
        return among[pick["n"] % len(among)]

    for key in ("x", "y", "z"):
        affinity.choose(key, [A, B], {}, {A: 0, B: 0}, rotate)
    assert len(affinity) == 2


def test_a_groups_dp_rank_is_stable_and_spreads():
    assert dp_rank(("d", 7), 4) == dp_rank(("d", 7), 4)
    ranks = {dp_rank(("d", line), 4) for line in range(64)}
    assert ranks == {0, 1, 2, 3}
    assert dp_rank(("d", 7), 1) == 0
    with pytest.raises(ValueError):
        dp_rank("x", 0)


@contextlib.asynccontextmanager
async def generate_server(answer: Callable[[web.Request], Awaitable[web.Response]]) -> AsyncIterator[str]:
    """A local HTTP server whose /generate is `answer`; yields its URL."""
    app = web.Application()
    app.router.add_post("/generate", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def test_the_request_body_carries_the_dp_rank_the_echo_and_the_reasoning_count():
    """The client over HTTP to a recorder: routed_dp_rank only for a server with several data-parallel schedulers,
    return_prompt_token_ids and require_reasoning when asked, the same rank for every sample of a prompt."""
    bodies: list[dict] = []

    async def generate(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        bodies.append(body)
        answer = {"text": "", "output_ids": [5, 2], "prompt_token_ids": body["input_ids"],
                  "meta_info": {"finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3,
                                "completion_tokens": 2, "cached_tokens": 2, "reasoning_tokens": 1}}
        return web.json_response(answer)

    async def main() -> None:
        async with generate_server(generate) as url:
            client = GenerateClient([url], echo_prompt_ids=True, count_reasoning=True, dp_ranks={url: 4})
            try:
                results = [await client.generate([1, 2, 3], {"max_new_tokens": 8}, None, ("d", 9)) for _ in range(3)]
                await client.generate([1, 2, 3], {"max_new_tokens": 8})
            finally:
                await client.aclose()
        assert all(r.cached_tokens == 2 and r.reasoning_tokens == 1 for r in results)

    asyncio.run(main())
    assert [b.get("routed_dp_rank") for b in bodies] == [dp_rank(("d", 9), 4)] * 3 + [None]
    assert all(b["return_prompt_token_ids"] is True and b["require_reasoning"] is True for b in bodies)


def test_an_answer_larger_than_the_request_can_take_is_given_up_at_once_and_the_replica_stays_live():
    """A capture knows its answer's size (hidden_capture.py's bound): a larger answer is the request's final failure
    after one attempt (asking again gets as large a one), read no further than the bound; the replica is not
    blamed, so the next request goes to it."""
    calls = []

    async def generate(request: web.Request) -> web.Response:
        calls.append(await request.read())
        return web.Response(body=b"x" * 4096, content_type="application/json")

    async def read(server: str, content: bytes, attempt: int) -> bytes:
        return content

    async def main() -> tuple[object, object]:
        async with generate_server(generate) as url:
            client = GenerateClient([url])
            try:
                return (await client.send(lambda attempt, server: b"{}", read, limit_bytes=1024),
                        await client.send(lambda attempt, server: b"{}", read, limit_bytes=8192))
            finally:
                await client.aclose()

    refused, taken = asyncio.run(main())
    assert isinstance(refused, GenerationFailure) and refused.attempts == 1
    assert "more than the request can take" in refused.message
    assert taken == b"x" * 4096 and len(calls) == 2


@pytest.mark.parametrize("echo", [False, True])
def test_the_body_sent_is_the_request_body_with_the_prompts_ids_encoded_once(echo: bool) -> None:
    """The bytes a request sends are orjson's encoding of `request_body` (what the contract tests check against each
    release's schema), though the prompt's ids are encoded once for all its samples and spliced in."""
    client = GenerateClient(["http://a", "http://b"], echo_prompt_ids=echo, count_reasoning=echo,
                            dp_ranks={"http://b": 2})
    ids = [0, 1, 2_000_000_000, 151_935, 7]
    prompt = PromptIds(array("i", ids))
    params = {"max_new_tokens": 8, "temperature": 0.6, "stop_token_ids": [2, 3]}
    for server in client.servers:
        for seed in (None, 2**63 - 1):
            for affinity in (None, ("d", 3)):
                sent = client.encode_body(server, prompt, params, seed, affinity)
                assert sent == orjson.dumps(client.request_body(server, ids, params, seed, affinity))
    assert prompt.json() is prompt.json(), "encoded once"


def preamble(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(blocks * BLOCK)]


def test_prefix_names_are_equal_exactly_as_far_as_the_leading_blocks_are():
    shared = preamble(1, 3)
    a, b = prefix_hashes(shared + [1] * 100), prefix_hashes(shared + [2] * 100)
    assert len(a) == len(b) == 4 and a[:3] == b[:3] and a[3] != b[3]
    changed = shared.copy()
    changed[BLOCK + 5] += 1  # the second block differs: so does every name from it on
    assert prefix_hashes(changed)[0] == a[0] and not set(prefix_hashes(changed)[1:]) & set(a)
    assert prefix_hashes(shared[:BLOCK - 1]) == []  # no whole block
    assert len(prefix_hashes([0] * (BLOCK * (MAX_PREFIX_BLOCKS + 5)))) == MAX_PREFIX_BLOCKS
    assert prefix_hashes(array("i", shared)) == prefix_hashes(shared)


def test_a_new_group_goes_where_its_shared_preamble_was_sent_and_groups_stay_together():
    """Two tool sets shared by many conversations: each new conversation goes to the replica that was sent its
    preamble (not the least-loaded one), and its later turns stay with it."""
    fleet = Fleet()
    tools_a, tools_b = preamble(1, 8), preamble(2, 8)

    def open_group(key: str, tools: list[int], tail: int) -> str:
        names = prefix_hashes(tools + [tail] * 2 * BLOCK)
        url = fleet.affinity.choose(key, fleet.replicas.candidates(), fleet.load, fleet.replicas.epochs(),
                                    lambda among: fleet.replicas.least_loaded(among, fleet.load), lambda: names)
        fleet.load[url] += 1
        return url

    home_a = open_group("a0", tools_a, 1)
    home_b = open_group("b0", tools_b, 2)
    assert home_a != home_b  # nothing shared yet: least loaded
    placed = [open_group(f"a{i}", tools_a, 10 + i) for i in range(1, 4)] + \
             [open_group(f"b{i}", tools_b, 20 + i) for i in range(1, 4)]
    assert placed == [home_a] * 3 + [home_b] * 3
    assert fleet.affinity.placed_by_prefix == 6
    assert fleet.send("a2") == home_a, "a conversation's later turns follow its key"
    # Past the spill gate the preamble's replica is skipped: the new group goes to the least loaded, which from
    # then on holds the preamble too.
    fleet.load[home_a] = 40
    spilled = open_group("a9", tools_a, 99)
    assert spilled not in (home_a,)
    fleet.load[home_a] = 0
    fleet.load[spilled] = 0
    assert open_group("a10", tools_a, 100) in (home_a, spilled)


def test_a_restarted_replica_is_not_credited_with_what_it_was_sent_before():
    fleet = Fleet((A, B))
    tools = preamble(3, 4)
    names = [prefix_hashes(tools + [i] * BLOCK) for i in range(3)]

    def open_group(key: str, index: int) -> str:
        return fleet.affinity.choose(key, fleet.replicas.candidates(), fleet.load, fleet.replicas.epochs(),
                                     lambda among: fleet.replicas.least_loaded(among, fleet.load),
                                     lambda: names[index])

    home = open_group("g0", 0)
    fleet.kill(home)
    fleet.revive(home)
    other = B if home == A else A
    fleet.load[other] = 1  # the restarted replica is the less loaded one, but it lost the preamble
    assert fleet.affinity.prefixes is not None
    assert fleet.affinity.prefixes.longest(names[1], [A, B], fleet.replicas.epochs()) == (0, [])
    assert open_group("g1", 1) == home  # least loaded, as nothing is known cached anywhere
    assert open_group("g2", 2) == home  # and now it was sent the preamble again


def test_the_prefix_record_is_bounded_forgetting_the_least_recently_used():
    record = PrefixRecord(max_blocks=8)
    old, new = prefix_hashes(preamble(4, 6)), prefix_hashes(preamble(5, 6))
    record.record(old, A, 0)
    record.record(new, B, 0)
    assert len(record) == 8
    assert record.longest(old, [A, B], {}) == (0, [])  # its first blocks went first
    assert record.longest(new, [A, B], {}) == (6, [B])
