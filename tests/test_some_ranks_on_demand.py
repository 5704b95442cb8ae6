"""The default (on-demand) schedule of a VLM's tower (``_schedule/on_demand.py``): gathered only on steps where
some rank's inputs hold images, released after the forward by ranks that did not run it, exact under gradient
accumulation, and a clear error (not a hang) when the images come under a name it does not know."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks
from _parity import global_mean, make_optimizer
from fsdp_plugin._schedule.on_demand import holds_modality
from test_some_ranks_vlm import STEPS, WORLD, collate, rank_batch, sample, tiny_llava


def test_holds_modality_finds_images_by_keyword_position_and_in_batch_dicts():
    pix, empty = torch.ones(1, 3, 8, 8), torch.ones(0, 3, 8, 8)
    names = ["input_ids", "pixel_values"]
    assert holds_modality((), {"pixel_values": pix}, names)
    assert holds_modality((torch.ones(2), pix), {}, names)                     # positional, by signature
    assert holds_modality(({"input_ids": 1, "pixel_values": pix}, 0), {}, ["batch", "idx"])   # Lightning
    assert holds_modality((), {"input_features": [pix]}, [])
    assert not holds_modality((), {"pixel_values": None, "input_ids": pix}, names)
    assert not holds_modality((), {"pixel_values": empty}, names)
    assert not holds_modality((torch.ones(2),), {}, names)


def _states(rank, world):
    """Per step: is the tower unsharded at the language model's first layer in forward, after the root forward,
    in backward (at layer 0's output gradient: before the tower's own backward), and at rest?"""
    model = fp.shard(tiny_llava(), timeout_s=60)
    root = model._fp_root
    assert root.on_demand
    tower = root.some_ranks_units[0]
    seen: list = []
    gathered = lambda: any(h.state.value != "sharded" for h in tower.handles)

    def layer0_forward(module, args, output):
        seen.append(gathered())
        out = output[0] if isinstance(output, tuple) else output
        out.register_hook(lambda g: seen.append(gathered()))
    model.model.language_model.layers[0].register_forward_hook(layer0_forward)
    opt = make_optimizer("sgd", model.parameters())
    out = []
    for s in range(STEPS):
        seen.clear()
        loss = model(**rank_batch(s, rank)).loss
        after_forward = gathered()
        loss.backward()
        out.append((seen[0], after_forward, seen[1], gathered()))
        opt.step()
        opt.zero_grad()
    return out


def test_gathered_only_on_steps_with_images_and_released_where_not_run():
    # images: step 0 rank 0; step 1 none; step 2 both ranks; step 3 rank 1 (test_some_ranks_vlm.HAS_IMAGE)
    r0, r1 = run_ranks(_states, WORLD, timeout=120)
    assert [s[0] for s in r0] == [s[0] for s in r1] == [True, False, True, True], (r0, r1)
    assert [s[1] for s in r0] == [s[1] for s in r1] == [True, False, True, True], (r0, r1)   # to the backward
    assert [s[2] for s in r0] == [True, False, True, False], r0       # in backward: held only where it ran
    assert [s[2] for s in r1] == [False, False, True, True], r1
    assert all(not s[3] for s in r0 + r1)                               # sharded at rest


def _two_forwards(rank, world):
    """Two root forwards before one backward: images on rank 0 in the first (rank 1 does not run the tower),
    anywhere in the second; the second's gather must find the same state on every rank."""
    model = fp.shard(tiny_llava(), timeout_s=60)
    opt = make_optimizer("sgd", model.parameters())
    losses = []
    for first, second in ((0, 2), (1, 3)):
        loss = (model(**rank_batch(first, rank)).loss + model(**rank_batch(second, rank)).loss) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss, world))
    return losses


def test_two_forwards_before_one_backward():
    got = run_ranks(_two_forwards, WORLD, timeout=120)[0]
    model = tiny_llava()
    opt = make_optimizer("sgd", model.parameters())
    want = []
    for first, second in ((0, 2), (1, 3)):
        batch = lambda k: collate([sample(i) for i in range(4 * k, 4 * k + 4)])
        loss = (model(**batch(first)).loss + model(**batch(second)).loss) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)


def _accumulating(rank, world, optim):
    model = fp.shard(tiny_llava(), timeout_s=60)
    opt = make_optimizer(optim, model.parameters())
    losses = []
    for s in range(0, STEPS, 2):        # two micro-batches per step: steps (0, 1) then (2, 3) of HAS_IMAGE
        with fp.no_sync(model):
            first = model(**rank_batch(s, rank)).loss / 2
            first.backward()
        second = model(**rank_batch(s + 1, rank)).loss / 2
        second.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(first.detach() + second.detach(), world))
    return losses


def _reference_accumulating(optim):
    model = tiny_llava()
    opt = make_optimizer(optim, model.parameters())
    losses = []
    for s in range(0, STEPS, 2):
        total = 0.0
        for k in (s, s + 1):
            loss = model(**collate([sample(i) for i in range(4 * k, 4 * k + 4)])).loss / 2
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_accumulation_across_steps_with_and_without_images(optim):
    """Micro-batch 1 has images (rank 0), micro-batch 2 none anywhere: the tower's accumulated gradient is
    reduced at the end of the second backward although it was not gathered then."""
    got = run_ranks(_accumulating, WORLD, optim, timeout=120)[0]
    want = _reference_accumulating(optim)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)


class _Renamed(nn.Module):
    """Takes the images under a name the default cannot know."""

    def __init__(self):
        super().__init__()
        self.vlm = tiny_llava()

    def forward(self, ids, images):
        return self.vlm(input_ids=ids, pixel_values=images, labels=ids).loss


def _renamed(rank, world):
    model = fp.shard(_Renamed(), timeout_s=60)
    batch = rank_batch(2, rank)        # step 2: images on both ranks
    try:
        model(batch["input_ids"], batch["pixel_values"])
    except fp.CollectiveError as e:
        return str(e)
    return "no error"


def test_images_under_an_unknown_name_raise_before_any_collective():
    msgs = run_ranks(_renamed, WORLD, timeout=120)
    assert msgs[0] == msgs[1] and "'vlm.model.vision_tower' (CLIPVisionModel)" in msgs[0], msgs
    assert "some_ranks_modules={'CLIPVisionModel'}" in msgs[0], msgs[0]


def _llava_inputs(images: bool):
    def make():
        batch = collate([sample(i) for i in (0, 1)] if images else [sample(i) for i in (4, 5)])
        return {k: batch[k] for k in ("input_ids", "labels", *(("pixel_values",) if images else ()))}
    return make


def test_plan_runs_llava_with_images_and_names_the_towers_cost():
    """LLaVA's forward checks that image tokens match image features (a boolean read from a tensor): the fake
    run takes the planned batch to be valid. The tower's activations then enter the plan, and a note gives
    its held full parameters and when the default pays them."""
    with_images = fp.plan(tiny_llava, 2, inputs=_llava_inputs(True))
    text_only = fp.plan(tiny_llava, 2, inputs=_llava_inputs(False))
    assert with_images.worlds[2].activations > text_only.worlds[2].activations
    assert "model.vision_tower" in with_images.worlds[2].unsharded_units
    tower = sum(p.numel() * 4 for p in tiny_llava().model.vision_tower.parameters())
    note = [n for n in with_images.notes if "'model.vision_tower' (CLIPVisionModel)" in n]
    assert len(note) == 1 and f"{tower / 1e6:.3g} MB per rank" in note[0] and "on demand" in note[0], note
    declared = fp.plan(tiny_llava, 2, inputs=_llava_inputs(True), some_ranks_modules={"CLIPVisionModel"})
    assert any("every step" in n for n in declared.notes), declared.notes


def test_plan_of_a_forward_reading_integers_names_the_way_out():
    """Qwen2-VL reads image grid sizes from its inputs (.tolist()): no fake run can; the error says what to do."""
    import test_some_ranks_qwen2vl as q

    with pytest.raises(fp.ConfigError, match="text-only inputs"):
        fp.plan(q.tiny_qwen2vl, 2, inputs=lambda: q.collate([q.sample(0), q.sample(1)]))
    text = fp.plan(q.tiny_qwen2vl, 2, inputs=lambda: q.collate([q.sample(1), q.sample(2)]))
    assert "model.visual" in text.worlds[2].unsharded_units


JOIN_STEPS = (4, 2)      # rank 1 runs out of batches after two steps and shadows the other two


def _joined(rank, world):
    from torch.distributed.algorithms.join import Join

    model = fp.shard(tiny_llava(), timeout_s=60)
    opt = make_optimizer("sgd", model.parameters())
    with Join([model]):
        for s in range(JOIN_STEPS[rank]):
            model(**rank_batch(s, rank)).loss.backward()
            opt.step()
            opt.zero_grad()
    return fp.full_state_dict(model)


def test_uneven_inputs_under_join():
    """A joined rank replays its last batch (no image) and takes part in the decision: at step 2 rank 0 holds
    an image (gathered on both ranks), at step 3 nobody does (gathered nowhere)."""
    got = run_ranks(_joined, WORLD, timeout=120)[0]
    model = tiny_llava()
    opt = make_optimizer("sgd", model.parameters())
    for s in range(max(JOIN_STEPS)):
        (sum(model(**rank_batch(s, r)).loss for r in range(WORLD) if s < JOIN_STEPS[r]) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    for k, v in model.state_dict().items():
        assert (got[k] - v).abs().max().item() <= 1e-5, k
