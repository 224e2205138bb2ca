"""Prompt encoding rules, the batch type and the weight-sync protocol, without an engine."""

import threading

import pytest
import torch

from learner.tiny_gpt import char_tokenizer
from rollout.pool import split_evenly, sync_ranks
from rollout.types import RolloutBatch
from rollout.weight_sync import (
    SyncGroup,
    TensorMeta,
    broadcast_staged,
    plan_buckets,
    receive_buckets,
    receive_weights,
    send_weights,
    stage_buckets,
    tensor_metas,
)
from runtime.ports import free_port
from runtime.prompts import PromptError, PromptOverflow, encode_prompt

tok = char_tokenizer()


def enc(prompt, max_tokens=8, overflow=PromptOverflow.truncate_left):
    return encode_prompt(tok, prompt, max_tokens, overflow)


def test_text_chat_and_ids_encode():
    ids, why = enc("1+2=?")
    assert why == "" and tok.decode(ids) == "1+2=?"
    ids, _ = enc([{"role": "user", "content": "1+2"}])
    assert tok.decode(ids) == "1+2\n"  # the tiny template: contents, one per line
    assert enc([5, 6, 7]) == ([5, 6, 7], "")


def test_a_bos_tokenizer_gets_exactly_one_bos_first():
    from bos_tokenizer import bos_tokenizer

    bt = bos_tokenizer()
    bos, o = bt.bos_token_id, PromptOverflow.error
    ids, _ = encode_prompt(bt, "1+2=", 64, o)
    assert ids == [bos] + bt("1+2=", add_special_tokens=False).input_ids  # the BOS the model was trained with
    assert encode_prompt(bt, "<s>1+2=", 64, o)[0] == ids  # the text's own BOS is not doubled
    chat, _ = encode_prompt(bt, [{"role": "user", "content": "1+2="}], 64, o)
    assert chat[0] == bos and chat.count(bos) == 1 and bt.decode(chat) == "<s>user: 1+2=\nassistant: "
    assert encode_prompt(bt, [bos, 5, 6], 64, o)[0] == [bos, 5, 6]  # token ids: as given
    cut, _ = encode_prompt(bt, "0123456789", 4, PromptOverflow.truncate_left)
    assert cut[0] == bos and bt.decode(cut[1:]) == "789"  # truncated on the left, the BOS kept


def test_the_tiny_char_tokenizer_still_adds_no_bos(tiny_model):
    from transformers import AutoTokenizer

    for t in (tok, AutoTokenizer.from_pretrained(tiny_model)):
        ids, _ = encode_prompt(t, "1+2=?", 64, PromptOverflow.error)
        assert ids == t("1+2=?", add_special_tokens=False).input_ids == [4, 13, 5, 16, 17]  # as before the fix
        messages = [{"role": "user", "content": "1+2"}]
        chat, _ = encode_prompt(t, messages, 64, PromptOverflow.error)
        assert chat == t.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    from runtime.prompts import encode_text

    assert encode_text(tok, "<eos><eos>1") == [1, 1, 4]  # its BOS text is its EOS: two written, two kept


@pytest.mark.parametrize(
    "prompt, reason",
    [
        ("", "empty prompt"),
        ("   ", "empty prompt"),
        ([], "empty prompt"),
        (5, "prompt is int; expected text, chat messages or token ids"),
        (None, "prompt is NoneType"),
        ({"text": "x"}, "prompt is dict"),
        ([{"role": "user"}], "chat message without a string 'content'"),
        ([1, 100000], "token id out of the vocabulary"),
        ([True, False], "prompt is list"),
    ],
)
def test_bad_prompts_are_skipped_with_a_reason(prompt, reason):
    ids, why = enc(prompt)
    assert ids is None and reason in why


def test_overlong_prompt_rules():
    long = "0123456789abc"
    ids, why = enc(long, 8, PromptOverflow.truncate_left)
    assert why == "" and tok.decode(ids) == "56789abc"  # the tail is kept: the question ends there
    ids, why = enc(long, 8, PromptOverflow.skip)
    assert ids is None and "13 tokens > max_prompt_tokens 8" in why
    with pytest.raises(PromptError, match="13 tokens"):
        enc(long, 8, PromptOverflow.error)


def test_batch_concat_and_padding():
    a = RolloutBatch([0, 0], [[1], [1]], [[5, 6], [7]], [[-0.1, -0.2], [-0.3]], ["ab", "c"], ["stop", "length"])
    b = RolloutBatch([2], [[2]], [[8, 9, 10]], [[-1.0, -2.0, -3.0]], ["xyz"], ["length"], skipped=[(1, "empty prompt")])
    c = RolloutBatch.concat([a, b])
    assert c.prompt_index == [0, 0, 2] and c.skipped == [(1, "empty prompt")] and len(c) == 3
    ids, lps, mask = c.padded(pad_id=0)
    assert ids.tolist() == [[5, 6, 0], [7, 0, 0], [8, 9, 10]]
    assert mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    assert torch.allclose(lps, torch.tensor([[-0.1, -0.2, 0], [-0.3, 0, 0], [-1.0, -2.0, -3.0]]))
    # policy versions travel with their samples through concat and select (dynamic sampling's regrouping)
    a.version_first, a.version_last, b.version_first, b.version_last = [3, 3], [3, 4], [5], [5]
    picked = RolloutBatch.concat([a, b]).select([2, 1])
    assert picked.version_first == [5, 3] and picked.version_last == [5, 4] and picked.response_ids == [[8, 9, 10], [7]]


def test_sync_ranks_give_every_tensor_parallel_worker_its_own_rank():
    assert sync_ranks(2, 1) == (3, [1, 2])
    # 3 engines of TP 4: sender 0, then engine i's workers at 1+4i .. 4+4i; no rank shared or skipped
    world, first = sync_ranks(3, 4)
    assert world == 13 and first == [1, 5, 9]
    assert sorted(f + tp for f in first for tp in range(4)) == list(range(1, world))


def test_cpu_tensor_parallel_workers_get_disjoint_cores(monkeypatch):
    import os

    from rollout.engine import cpu_bind

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 4, 5})  # a process pinned to cores 2-5
    cores = sorted(os.sched_getaffinity(0))
    assert cpu_bind(2) == "2-3|4-5"
    parts = cpu_bind(2).split("|")
    assert len(parts) == 2 and parts[0].split("-")[0] == str(cores[0])
    with pytest.raises(ValueError, match="tensor_parallel_size: .* CPU workers need at least"):
        cpu_bind(len(cores) + 1)


def test_split_evenly():
    assert split_evenly(5, 2) == [(0, 3), (3, 5)]
    assert split_evenly(2, 3) == [(0, 1), (1, 2), (2, 2)]


def test_buckets_keep_one_dtype_and_respect_the_size():
    metas = [
        TensorMeta("a", (4,), "float32"),
        TensorMeta("b", (4,), "float32"),
        TensorMeta("c", (2,), "bfloat16"),
        TensorMeta("d", (100,), "bfloat16"),
        TensorMeta("e", (1,), "bfloat16"),
    ]
    buckets = plan_buckets(metas, bucket_bytes=32)
    assert [[m.name for m in b] for b in buckets] == [["a", "b"], ["c"], ["d"], ["e"]]


def test_broadcast_round_trip_over_gloo_in_buckets():
    g = torch.Generator().manual_seed(0)
    weights = {
        "w1": torch.randn(3, 5, generator=g),
        "b1": torch.randn(5, generator=g),
        "emb": torch.randn(7, 2, generator=g).to(torch.bfloat16),
    }
    buckets = plan_buckets(tensor_metas(weights.items()), bucket_bytes=64)
    assert len(buckets) == 3
    port, received, pointers = free_port(), [{}, {}], [set(), set()]

    def receiver():
        group = SyncGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=30)
        for sync in range(2):  # into the group's reusable buffers: two syncs, same memory
            for name, t in receive_weights(group, buckets, reuse=True):
                received[sync][name] = t.clone()
                pointers[sync].add(t.untyped_storage().data_ptr())

    th = threading.Thread(target=receiver)
    th.start()
    sender = SyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=30)
    sent = send_weights(sender, buckets, weights.__getitem__)
    second = {k: v * 2 for k, v in weights.items()}
    send_weights(sender, buckets, second.__getitem__)
    th.join(timeout=30)
    assert sent == 15 * 4 + 5 * 4 + 14 * 2
    for sync, expected in enumerate([weights, second]):
        assert set(received[sync]) == set(expected)
        for name, t in expected.items():
            assert received[sync][name].dtype == t.dtype and torch.equal(received[sync][name], t)
    assert pointers[0] == pointers[1] and len(pointers[0]) == 3  # float32 slots 0 and 1, bfloat16 slot 0


def test_a_staged_sync_sends_the_weights_as_they_were_when_staged():
    """Asynchronous training stages a copy and broadcasts it while the learner trains on: what
    arrives is the staged weights, whatever the learner wrote since, and the buffers are reused."""
    weights = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    buckets = plan_buckets(tensor_metas(weights.items()), bucket_bytes=1 << 20)
    port, received = free_port(), {}

    def receiver():
        group = SyncGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=30)
        received.update((n, t.clone()) for n, t in receive_weights(group, buckets))

    th = threading.Thread(target=receiver)
    th.start()
    sender = SyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=30)
    staged = stage_buckets(buckets, weights.__getitem__)
    weights["w"].add_(100.0)  # the learner's next update
    broadcast_staged(sender, staged)
    th.join(timeout=30)
    assert torch.equal(received["w"], torch.arange(6.0).view(2, 3)) and torch.equal(received["b"], weights["b"])
    again = stage_buckets(buckets, weights.__getitem__, staged)
    assert [t.data_ptr() for t in again] == [t.data_ptr() for t in staged] and again[0][0] == 100.0


def test_a_tensor_marked_transposed_travels_transposed_and_arrives_in_its_own_layout():
    g = torch.Generator().manual_seed(0)
    weights = {"conv1d": torch.randn(3, 5, generator=g), "bias": torch.randn(5, generator=g)}
    buckets = [[TensorMeta("conv1d", (3, 5), "float32", transposed=True), TensorMeta("bias", (5,), "float32")]]
    port, flats, received = free_port(), [], {}

    def receiver():
        group = SyncGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=30)
        flats.extend(f.clone() for f in receive_buckets(group, buckets))
        received.update((n, t.clone()) for n, t in receive_weights(group, buckets))

    th = threading.Thread(target=receiver)
    th.start()
    sender = SyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=30)
    for _ in range(2):
        send_weights(sender, buckets, weights.__getitem__)
    th.join(timeout=30)
    assert torch.equal(flats[0][:15].view(5, 3), weights["conv1d"].t())  # on the wire: the transpose
    assert torch.equal(flats[0][15:], weights["bias"])
    for name, t in weights.items():  # handed to a loader: the Hugging Face layout again
        assert received[name].shape == t.shape and torch.equal(received[name], t)


def test_pack_unpad_and_ragged_to_dense_by_hand():
    """Prompt + response rows right-padded in one scatter; the response mask lines up with the
    logits [:, :-1] (position j predicts token j + 1); unpad and ragged_to_dense invert each other."""
    from learner.experience import ragged_to_dense
    from rollout.types import pack, unpad

    ids, attention, positions, response = pack([[1, 2], [3]], [[4], [5, 6, 7]], pad_id=0)
    assert ids.tolist() == [[1, 2, 4, 0], [3, 5, 6, 7]]
    assert attention.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert positions.tolist() == [[0, 1, 2, 2], [0, 1, 2, 3]]
    assert response.tolist() == [[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    values = torch.tensor([[9.0, 0.5, 9.0], [0.25, 1.5, 2.5]])
    assert unpad(values, response) == [[0.5], [0.25, 1.5, 2.5]]
    assert torch.equal(ragged_to_dense([[0.5], [0.25, 1.5, 2.5]], response), values * response)
    with pytest.raises(ValueError, match="row lengths"):
        ragged_to_dense([[0.5, 1.0], [0.25]], response)


def test_cut_samples_are_continued_in_place_and_keep_what_they_had_sampled():
    """Partial rollouts (RolloutBatch.continued): a checkpoint's cut samples ("partial") are joined to
    their continuations token for token; finished samples are untouched; a sample cut before its
    first token is all continuation, its first version included."""
    batch = RolloutBatch(
        [0, 0, 1],
        [[1], [1], [2]],
        [[5, 6], [7], []],
        [[-0.1, -0.2], [-0.3], []],
        ["ab", "c", ""],
        ["partial", "stop", "partial"],
        version_first=[3, 3, 4],
        version_last=[3, 3, 4],
        token_versions=[[3, 3], [3], []],
    )
    assert batch.partial_rows() == [0, 2]
    more = RolloutBatch(
        [0, 1],
        [[1, 5, 6], [2]],
        [[8], [9, 10]],
        [[-0.8], [-0.9, -1.0]],
        ["ab8", "9a"],
        ["stop", "length"],
        version_first=[5, 5],
        version_last=[5, 6],
        token_versions=[[5], [5, 6]],
    )
    assert batch.continued([0, 2], more) is batch and batch.partial_rows() == []
    assert batch.response_ids == [[5, 6, 8], [7], [9, 10]]
    assert batch.logprobs == [[-0.1, -0.2, -0.8], [-0.3], [-0.9, -1.0]]
    assert batch.token_versions == [[3, 3, 5], [3], [5, 6]]
    assert batch.version_first == [3, 3, 5] and batch.version_last == [5, 3, 6]
    assert batch.response_text == ["ab8", "c", "9a"] and batch.finish_reason == ["stop", "stop", "length"]
    assert batch.oldest_versions == [3, 3, 5]
    with pytest.raises(ValueError, match="1 continuations for 2 cut samples"):
        batch.continued([0, 1], more.select([0]))
