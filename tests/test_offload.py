"""CPU offload's host side (issue 49, ``fsdp_plugin/_flat/offload.py``), on CPU.

The copier's code path (pinned exact-size host blocks, copies through side streams with events, one host wait per
backward, reused gradient buffers, the fused host optimizer step) runs here on CPU through ``fsdp_plugin.testing.fake.FakeBackend``: its
streams and events are recorders, so the tests count what a CUDA run would do (host waits and host allocations
per step) and check that training equals training without offload.
"""
import gc
import warnings

import pytest
import torch

import fsdp_plugin as fp
from fsdp_plugin._flat import offload
from fsdp_plugin.testing import fake
from models import GPT, Block, gpt_batch

BF16 = fp.MixedPrecision(param_dtype=torch.bfloat16)


@pytest.fixture
def fake_offload(monkeypatch):
    """fp.shard(..., cpu_offload=True) on CPU takes the CUDA code path with recording streams and events."""
    made = []

    def factory(device):
        made.append(fake.FakeBackend(device))
        return made[-1]
    monkeypatch.setattr(offload, "for_config", fake.offloading_for_config(factory))
    return made


def _model(n_layer=3, **cfg):
    torch.manual_seed(0)
    return fp.shard(GPT(n_layer=n_layer), auto_wrap_policy={Block}, **cfg)


def _optimizer(model, kind, **kw):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, **kw)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **kw)


def _train(model, opt, steps, each=None, set_to_none=True):
    losses = []
    for s in range(steps):
        loss = model(*gpt_batch(s, 0))
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if each is not None:
            each(s)
    return losses


def _params(model):
    with fp.full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------ the host optimizer step
@pytest.mark.parametrize("cls,kw", [(torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)),
                                    (torch.optim.Adam, dict(lr=1e-3)),
                                    (torch.optim.Adam, dict(lr=1e-3, weight_decay=0.01, amsgrad=True)),
                                    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
                                    (torch.optim.SGD, dict(lr=0.1))])
def test_fused_cpu_kernel_against_the_default_loop(cls, kw):
    """What switching an offloaded optimizer to fused=True changes: an ulp or two (measured after 10 steps on
    values ~1: AdamW/Adam 1.2e-7, amsgrad 2.4e-7, SGD nesterov+weight decay 3e-8, plain SGD 0): under 1e-6."""
    torch.manual_seed(0)
    p0 = [torch.randn(1000, 37), torch.randn(4099)]
    a = [p.clone().requires_grad_() for p in p0]
    b = [p.clone().requires_grad_() for p in p0]
    oa, ob = cls(a, **kw), cls(b, fused=True, **kw)
    for _ in range(10):
        for x, y in zip(a, b):
            x.grad = torch.randn_like(x)
            y.grad = x.grad.clone()
        oa.step()
        ob.step()
    worst = max((x - y).abs().max().item() for x, y in zip(a, b))
    assert worst <= 1e-6, "not always bit-exact (so documented), and within 1e-6"
    # "an ulp or two": against each value's own float32 spacing (torch.finfo), not a restated measurement
    ulps = max(((x - y).abs() / (torch.finfo(torch.float32).eps * y.abs().clamp_min(2.0 ** -10))).max().item()
               for x, y in zip(a, b))
    assert ulps <= 4, ulps


def test_default_adamw_gets_the_fused_kernel_and_explicit_choices_are_kept(fake_offload):
    model = _model(cpu_offload=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _train(model, opt, 2)
    assert all(g["fused"] for g in opt.param_groups)
    said = [x for x in w if "cpu_offload" in str(x.message)]
    assert len(said) == 1 and "fused CPU kernel" in str(said[0].message), "one warning that it was switched"
    assert "FSDP_PLUGIN_OFFLOAD_FUSED=0" in str(said[0].message) and "fused=True" in str(said[0].message)
    assert opt.defaults["fused"] is None and opt.defaults["foreach"] is None, "defaults stay the user's"

    model = _model(cpu_offload=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _train(model, opt, 3)
    slow = [x for x in w if "one-tensor-at-a-time" in str(x.message)]
    assert len(slow) == 1 and "fused=True" in str(slow[0].message), "one warning, at the first step, naming the fix"
    assert not any(g["fused"] for g in opt.param_groups)


def test_a_group_with_a_parameter_the_fused_kernel_cannot_take_is_not_switched(fake_offload):
    """Every parameter of every group is checked, not only the offloaded ones: a bfloat16 extra parameter keeps
    the optimizer on torch's loop (with the one warning naming fused=True)."""
    model = _model(cpu_offload=True)
    extra = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([{"params": list(model.parameters())}, {"params": [extra]}], lr=1e-3)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _train(model, opt, 1)
    assert not any(g["fused"] for g in opt.param_groups)
    assert [x for x in w if "one-tensor-at-a-time" in str(x.message)]


def test_fused_switch_can_be_turned_off(fake_offload, monkeypatch):
    monkeypatch.setenv("FSDP_PLUGIN_OFFLOAD_FUSED", "0")
    model = _model(cpu_offload=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, 1)
    assert not any(g["fused"] for g in opt.param_groups)


# ------------------------------------------------------------------ CPU-only runs
def test_cpu_offload_on_a_cpu_run_warns_once_and_does_nothing():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model = _model(cpu_offload=True)
        _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), 2)
    said = [x for x in w if "cpu_offload" in str(x.message)]
    assert len(said) == 1 and "does nothing" in str(said[0].message)
    assert model._fp_root.offload is None
    assert all(h.offload is None for u in model._fp_root.units for h in u.handles)


# ------------------------------------------------------------------ parity with no offload
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("mp", [None, BF16], ids=["fp32", "bf16"])
def test_offload_trains_like_no_offload(fake_offload, kind, mp):
    """fp32 masters, the same optimizer kernel: the reference is given fused=True, which offload picks by itself
    (the fused kernel against torch's default loop: test_fused_cpu_kernel_against_the_default_loop)."""
    cfg = {} if mp is None else {"mixed_precision": mp}
    ref = _model(**cfg)
    want_losses = _train(ref, _optimizer(ref, kind, fused=True), 4)
    model = _model(cpu_offload=True, **cfg)
    losses = _train(model, _optimizer(model, kind), 4)
    copier = model._fp_root.offload
    assert copier is not None and copier.stats.d2h_copies and copier.stats.h2d_copies, "the offload path ran"
    assert all(h.offload is copier and not h._aliases_shard for u in model._fp_root.units for h in u.handles)
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-6
    want, got = _params(ref), _params(model)
    worst = max((want[n] - got[n]).abs().max().item() for n in want)
    assert worst <= 1e-6, worst


def test_offload_parity_can_fail(fake_offload, monkeypatch):
    """A copier that drops a gradient copy is caught by the parity check above."""
    real = offload.HostCopier._copy_to_host

    def lossy(self, dst, src):
        real(self, dst, src)
        dst.zero_()
    ref = _model()
    _train(ref, _optimizer(ref, "sgd"), 2)
    monkeypatch.setattr(offload.HostCopier, "_copy_to_host", lossy)
    model = _model(cpu_offload=True)
    _train(model, _optimizer(model, "sgd"), 2)
    want, got = _params(ref), _params(model)
    assert max((want[n] - got[n]).abs().max().item() for n in want) > 1e-3


# ------------------------------------------------------------------ counted: per step, not per unit
@pytest.mark.parametrize("n_layer", [1, 3, 6])
def test_host_waits_and_allocations_per_step_do_not_grow_with_units(fake_offload, n_layer):
    model = _model(n_layer=n_layer, cpu_offload=True, mixed_precision=BF16)
    copier = model._fp_root.offload
    handles = [h for u in model._fp_root.units for h in u.handles]
    allocs_at_build = copier.stats.host_allocs
    assert allocs_at_build == len(handles), "one pinned master shard per handle"
    per_step = []

    def record(step):
        per_step.append(copier.stats.snapshot())
        copier.stats.reset()
    _train(model, _optimizer(model, "adamw"), 4, each=record)
    # step 0 makes each handle's gradient buffer once; from then on nothing is allocated
    assert per_step[0]["host_allocs"] == allocs_at_build + len(handles)
    for s in per_step[1:]:
        # one wait at the end of backward: the gradients' copies and the masters' readers (h2d) both
        assert s["sync_sites"] == {"end_of_backward": 1}, s
        assert s["host_allocs"] == 0 and s["host_alloc_bytes"] == 0, s
        assert s["d2h_copies"] == len(handles)
    assert per_step[0]["syncs"] == 1
    fake = fake_offload[-1]
    assert fake.d2h.waited >= len(handles), "every gradient copy waits for its gradient on the GPU, not the host"


def test_per_unit_waits_would_be_caught(fake_offload, monkeypatch):
    """The count above fails for a copier that waits once per gradient copy."""
    real = offload.HostCopier._copy_to_host

    def eager(self, dst, src):
        real(self, dst, src)
        self._sync(self._last_d2h, "per_copy")
    monkeypatch.setattr(offload.HostCopier, "_copy_to_host", eager)
    model = _model(n_layer=3, cpu_offload=True)
    copier = model._fp_root.offload
    _train(model, _optimizer(model, "sgd"), 1)
    assert copier.stats.syncs > 1


# ------------------------------------------------------------------ gradient buffers
def test_gradient_buffer_is_reused_unless_the_user_holds_it(fake_offload):
    model = _model(cpu_offload=True)
    copier = model._fp_root.offload
    opt = _optimizer(model, "sgd")
    _train(model, opt, 2)
    p = next(model.parameters())
    base_before = p.grad._base.data_ptr()
    copier.stats.reset()
    _train(model, opt, 1)
    assert copier.stats.host_allocs == 0 and p.grad._base.data_ptr() == base_before, "reused"
    kept = p.grad                     # the user keeps last step's gradient
    kept_values = kept.clone()
    copier.stats.reset()
    _train(model, opt, 1)             # zero_grad(set_to_none=True) inside: p.grad dropped, ``kept`` held
    assert copier.stats.host_allocs == 1, "a new buffer for that handle: the held gradient keeps its values"
    assert torch.equal(kept, kept_values) and p.grad._base.data_ptr() != kept._base.data_ptr()


def test_accumulating_backwards_add_into_the_bound_gradient(fake_offload):
    """Gradients not zeroed between backwards accumulate (staging + add after the one wait), as without offload."""
    def grads(model):
        for s in range(2):
            model(*gpt_batch(s, 0)).backward()
        return [p.grad.clone() for p in model.parameters()]
    ref = _model()
    want = grads(ref)
    model = _model(cpu_offload=True)
    copier = model._fp_root.offload
    got = grads(model)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(want, got))
    assert copier.stats.syncs == 2 and copier.stats.sync_sites == {"end_of_backward": 2}
    assert len(copier._staging) == sum(len(u.handles) for u in model._fp_root.units)


def test_forward_without_backward_is_waited_before_the_step(fake_offload):
    model = _model(cpu_offload=True)
    copier = model._fp_root.offload
    opt = _optimizer(model, "sgd")
    _train(model, opt, 1)
    copier.stats.reset()
    with torch.no_grad():
        model(*gpt_batch(9, 0))
    opt.step()     # writes the masters the forward's copies read: one wait first
    assert copier.stats.sync_sites == {"before_optimizer_step": 1}


# ------------------------------------------------------------------ pinned blocks
def test_host_block_is_exact_size_zeroed_and_unregistered_when_freed():
    pinned = {}
    t = offload.host_block(1000, torch.float32, pinned.__setitem__, pinned.pop)
    assert t.numel() == 1000 and not t.any() and pinned == {t.data_ptr(): 4000}
    view = t[10:20]
    del t
    gc.collect()
    assert pinned, "a view keeps the block (and its registration)"
    del view
    gc.collect()
    assert pinned == {}, "unregistered before the memory is unmapped"


def test_cuda_streams_exist_only_on_cuda():
    assert offload.for_config(False, torch.device("cpu")) is None
    with pytest.warns(UserWarning, match="does nothing"):
        assert offload.for_config(True, torch.device("cpu")) is None


# ------------------------------------------------------------------ world 2: the all-gather's source is the copy
def _world2(rank, world, offloaded):
    from _parity import train
    if offloaded:
        fake.offload_on_cpu()     # forked rank: the same CPU stand-in as the fixture
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, cpu_offload=offloaded, mixed_precision=BF16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    losses = train(model, opt, rank, world, 3)
    stats = model._fp_root.offload.stats.snapshot() if offloaded else None
    return losses, fp.full_state_dict(model), stats


def test_offload_at_world_2_trains_like_no_offload():
    from _dist import run_ranks
    want_losses, want, _ = run_ranks(_world2, 2, False)[0]
    losses, got, stats = run_ranks(_world2, 2, True)[0]
    assert stats["h2d_copies"] and stats["d2h_copies"] and stats["syncs"] == 1 * 3     # one host wait per step
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-6
    assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-6


# ------------------------------------------------------------------ unused parameters and slots without gradients
class _Partly(torch.nn.Module):
    """One unit whose ``spare`` is used only on even steps: its slot's gradient comes and goes."""

    def __init__(self):
        super().__init__()
        self.a, self.spare, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x, use_spare):
        h = self.a(x)
        if use_spare:
            h = self.spare(h)
        return self.b(h).square().mean()


def _partly_grads(offloaded, set_to_none):
    torch.manual_seed(0)
    model = fp.shard(_Partly(), cpu_offload=offloaded)
    out = []
    for s in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s))
        if s % 2 == 0 or set_to_none:
            model.zero_grad(set_to_none=set_to_none)
        model(x, s % 2 == 0).backward()
        out.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("set_to_none", [True, False])
def test_slots_without_gradients_match_no_offload(fake_offload, set_to_none):
    """``p.grad`` None for a slot no backward used (and kept, added to, where it had one), as without offload."""
    want, got = _partly_grads(False, set_to_none), _partly_grads(True, set_to_none)
    assert any(x is None for w in want for x in w) == set_to_none, "the unused slot's gradient comes and goes"
    for w, g in zip(want, got):
        assert [x is None for x in w] == [x is None for x in g]
        assert all(x is None or torch.allclose(x, y, rtol=0, atol=1e-7) for x, y in zip(w, g))


def test_world_1_copy_is_waited_where_the_unit_uses_it(fake_offload):
    """At world 1 the current stream waits for a handle's copy in its wait_unshard, not when the copy is issued (a
    prefetch runs beside the prefetching unit's compute); the filled buffer is the master in the compute dtype."""
    model = _model(cpu_offload=True, mixed_precision=BF16)
    _train(model, _optimizer(model, "sgd"), 1)
    fake = fake_offload[-1]
    h = model._fp_root.units[1].handles[0]
    assert h.state.value == "sharded"
    before = fake.current().waited
    h.unshard()
    assert h.state.value == "unsharding" and fake.current().waited == before
    h.wait_unshard()
    assert h.state.value == "unsharded" and fake.current().waited == before + 1
    assert torch.equal(h._full, h.flat_shard.to(torch.bfloat16))
    h.reshard()


def test_cuda_backend_calls_on_stand_ins(monkeypatch):
    """The CUDA backend's own calls (streams, events, cudaHostRegister/Unregister; never record_stream) on
    stand-ins for torch.cuda, training on CPU."""
    calls = {"stream": 0, "record": 0, "sync": 0, "wait": 0, "record_stream": 0}
    registered = {}

    class Stream:
        def __init__(self, device=None):
            calls["stream"] += 1

        def wait_event(self, ev):
            calls["wait"] += 1

    class Event:
        def record(self, stream=None):
            calls["record"] += 1

        def synchronize(self):
            calls["sync"] += 1

    class CudaRT:
        @staticmethod
        def cudaHostRegister(ptr, nbytes, flags):
            registered[ptr] = nbytes
            return 0

        @staticmethod
        def cudaHostUnregister(ptr):
            del registered[ptr]
            return 0

    main = Stream()
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: CudaRT)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, s: calls.__setitem__("record_stream", calls["record_stream"] + 1))
    monkeypatch.setattr(offload, "for_config", fake.offloading_for_config(offload._CudaBackend))
    model = _model(cpu_offload=True, mixed_precision=BF16)
    handles = [h for u in model._fp_root.units for h in u.handles]
    assert calls["stream"] == 1 + 2 and len(registered) == len(handles), "two copy streams; one block per shard"
    _train(model, _optimizer(model, "adamw"), 2)
    assert calls["sync"] == 2 * 1 and len(registered) == 2 * len(handles), "one host wait per step; gradient blocks"
    assert calls["record_stream"] == 0, "buffers are held until a stream wait, never record_stream'ed"
    t = offload.host_block(100, torch.float32, offload._cuda_register, offload._cuda_unregister)
    assert registered[t.data_ptr()] == 400
    del t
    gc.collect()
    assert len(registered) == 2 * len(handles), "a block is unregistered when its last tensor goes"


# ------------------------------------------------------------------ issue 53, finding 10: host writes to masters
class _OrderedBackend(fake.FakeBackend):
    """FakeBackend whose streams carry vector clocks, so a test can ask what the host knows has finished: an
    h2d copy is a position on the h2d stream; ``wait_event`` orders a stream after an event's position (and
    what that stream knew); ``synchronize`` tells the host. ``current`` is settable: the gather stream at
    world > 1 (``to_device`` inside ``streams.on(gather)``), the compute stream elsewhere."""

    class Stream(fake.FakeBackend.Stream):
        def __init__(self, name):
            super().__init__(name)
            self.pos, self.knows = 0, {}

        def wait_event(self, event):
            super().wait_event(event)
            for k, v in event.knows.items():
                self.knows[k] = max(self.knows.get(k, 0), v)

    class Event(fake.FakeBackend.Event):
        def __init__(self, stream):
            super().__init__(stream)
            self.knows = {**stream.knows, stream.name: stream.pos}

    def __init__(self, device=torch.device("cpu")):
        super().__init__(device)
        self.host = {}
        self.gather = self.Stream("gather")

    def event(self, stream):
        ev = self.Event(stream)
        host = self.host

        def synchronize(ev=ev):
            ev.synced += 1
            for k, v in ev.knows.items():
                host[k] = max(host.get(k, 0), v)
        ev.synchronize = synchronize
        return ev

    def use(self, stream):
        if stream is self.h2d or stream is self.d2h:
            stream.pos += 1          # the copy issued inside is that copy stream's next operation
        return super().use(stream)


def test_no_host_write_to_masters_before_every_h2d_copy_is_known_done():
    """World > 1: the all-gather's source is copied on the h2d stream and waited by the GATHER stream; the
    gradient's copy to the host is ordered after the COMPUTE stream. The host's end-of-backward wait therefore
    says nothing about the h2d copy, and before the optimizer writes the masters the host must have synchronized
    an h2d event recorded after it. (Before issue 53 a flag, cleared by that gradient copy, skipped the wait.)"""
    b = _OrderedBackend()
    copier = offload.HostCopier(torch.device("cpu"), b)
    shard = copier.host_tensor(8, torch.float32)
    b._current = b.gather
    copier.to_device(shard)                 # the all-gather's source: the gather stream waits for it
    b._current = b.Stream("compute")
    copier._copy_to_host(copier.host_tensor(8, torch.float32), torch.ones(8))    # a reduced gradient
    copier.before_host_update()             # the optimizer step's pre-hook
    assert b.host.get("h2d", 0) >= b.h2d.pos == 1, (b.host, b.h2d.pos)
    assert copier.stats.sync_sites == {"end_of_backward": 1}, "one wait covers the gradient and the h2d copy"
    copier.before_host_update()             # nothing issued since: no second wait
    assert copier.stats.syncs == 1


def test_a_state_dict_load_waits_for_copies_reading_the_masters(fake_offload):
    """``fp.full_params``' write-back (and every load) writes the pinned masters: the h2d copies of a forward
    without backward are waited first, once, on their own stream."""
    model = _model(cpu_offload=True)
    copier = model._fp_root.offload
    with torch.no_grad():
        model(*gpt_batch(0, 0))
    copier.stats.reset()
    with fp.full_params(model):      # writes every master back on exit
        pass
    assert copier.stats.sync_sites.get("before_host_write", 0) == 1, copier.stats.sync_sites


def test_a_copys_device_buffer_is_released_only_after_its_pools_stream_is_ordered_after_the_copy():
    """No ``record_stream``: (1) a host-to-device copy's destination is allocated on the stream that uses it and
    ``h2d`` waits for that stream before writing it (the block's earlier users there are done); (2) a gradient
    chunk read by the d2h copy stays held by the copier until the current stream waited for that copy on the
    GPU (the next gradient copy) or the host did (end of backward)."""
    import gc
    import weakref

    b = _OrderedBackend()
    copier = offload.HostCopier(torch.device("cpu"), b)
    compute = b.current()
    compute.pos = 5                                     # work the compute stream queued before the copy
    copier.to_device(copier.host_tensor(8, torch.float32))
    assert b.h2d.knows.get("current", 0) == 5, "h2d waits for the destination's stream before writing it"
    assert compute.knows.get("h2d", 0) >= 1, "the user waits for the copy before reading it"

    chunks = [torch.ones(8), torch.ones(8)]
    alive = [weakref.ref(c) for c in chunks]
    copier._copy_to_host(copier.host_tensor(8, torch.float32), chunks[0])     # the d2h stream's op #1
    del chunks[0]
    gc.collect()
    assert alive[0]() is not None, "held while the d2h copy may still read it"
    copier._release_reading()
    gc.collect()
    assert alive[0]() is None and compute.knows.get("d2h", 0) == 1, "released once compute is ordered after it"
    copier._copy_to_host(copier.host_tensor(8, torch.float32), chunks[0])
    del chunks[0]
    gc.collect()
    assert alive[1]() is not None
    copier.finish_backward()                             # the host saw every copy finish
    gc.collect()
    assert alive[1]() is None
