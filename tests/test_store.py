"""HostStore: exact-size 64-byte-aligned arena, views that alias it, load/copy round trips, budgets, pin errors and
lifetime. CUDA twins skip without a GPU."""
import gc
import warnings

import numpy as np
import pytest
import torch

import pyengine
from pyengine import store as store_module

CUDA = torch.cuda.is_available()
PAGE = 4096
ODD_SIZES = [1, 7, 17, 4097, 1_000_003]


class OddNet(torch.nn.Module):
    def __init__(self, sizes=ODD_SIZES):
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n)) for n in sizes)
        self.mat = torch.nn.Parameter(torch.randn(13, 11))


def buffers(store):
    out = {"param": store.param, "exp_avg": store.exp_avg, "exp_avg_sq": store.exp_avg_sq}
    if store.max_exp_avg_sq is not None:
        out["max_exp_avg_sq"] = store.max_exp_avg_sq
    if store.shadow is not None:
        out["shadow"] = store.shadow
    out.update({f"grad{g}": store.grad_slot(g) for g in range(store.workers)})
    return out


def make(model, **kw):
    kw.setdefault("pin", False)
    return pyengine.HostStore(model, **kw)


@pytest.mark.parametrize("grad_dtype,shadow_dtype,amsgrad,workers", [
    (torch.float32, None, False, 1),
    (torch.float32, None, True, 3),
    (torch.bfloat16, torch.bfloat16, False, 2),
    (torch.float16, torch.float16, True, 4),
])
def test_layout_alignment_views_and_exact_size(grad_dtype, shadow_dtype, amsgrad, workers):
    model = OddNet()
    store = make(model, workers=workers, grad_dtype=grad_dtype, shadow_dtype=shadow_dtype, amsgrad=amsgrad)
    bufs = buffers(store)
    # Reverse registration order, offsets increasing, no overlap.
    assert store.names == [name for name, _ in reversed(list(model.named_parameters()))]
    for prev, entry in zip(store.layout, store.layout[1:]):
        assert entry.offset >= prev.offset + prev.numel
    # One arena of exactly nbytes; every buffer a view of it, disjoint, each parameter on a 64-byte boundary.
    storage = store.param.untyped_storage()
    assert storage.nbytes() == store.nbytes
    spans = []
    for name, flat in bufs.items():
        assert flat.dim() == 1 and flat.numel() == store.numel, name
        assert flat.untyped_storage().data_ptr() == storage.data_ptr(), name
        spans.append((flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()))
        for entry in store.layout:
            assert (flat.data_ptr() + entry.offset * flat.element_size()) % 64 == 0, (name, entry.name)
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    # Note [Staggered sections]: buffers of these sizes start at distinct offsets within 2 MiB pages: no stagger
    assert [b[0] - a[1] for a, b in zip(spans, spans[1:])] == [0] * (len(spans) - 1)
    assert sum(b - a for a, b in spans) == store.nbytes
    # Size bound: parameter bytes per buffer plus less than one alignment unit per tensor per buffer, plus a page.
    align = 64 // min(t.element_size() for t in bufs.values())
    bound = PAGE
    for flat in bufs.values():
        bound += sum((e.numel + align - 1) * flat.element_size() for e in store.layout)
    assert store.nbytes <= bound
    if align == 16:  # all-fp32 store: the bound, 64 B per tensor per buffer
        P = len(store.layout)
        assert store.nbytes <= sum(e.numel * 4 for e in store.layout) * len(bufs) + 64 * P * len(bufs) + PAGE


def test_views_alias_arena_and_padding_is_zero():
    model = OddNet()
    store = make(model, workers=2, shadow_dtype=torch.bfloat16)
    named = dict(model.named_parameters())
    views = store.views(store.param)
    for name, view in views.items():
        assert view.shape == named[name].shape
        assert torch.equal(view, named[name].detach())
        assert view.untyped_storage().data_ptr() == store.param.untyped_storage().data_ptr()
    name = store.names[2]
    entry = store.entry(name)
    views[name].view(-1)[0] = 123.5
    assert store.param[entry.offset].item() == 123.5
    assert store.shadow[entry.offset].item() != 123.5  # the shadow is a separate buffer: untouched by the write
    mask = torch.ones(store.numel, dtype=torch.bool)
    for e in store.layout:
        mask[e.offset:e.offset + e.numel] = False
    assert mask.any()
    for name, flat in buffers(store).items():
        assert torch.count_nonzero(flat[mask]) == 0, name
    for name, flat in buffers(store).items():
        if name not in ("param", "shadow"):
            assert torch.count_nonzero(flat) == 0, name


def test_load_from_copy_to_round_trip_bit_exact():
    src, dst = OddNet(), OddNet()
    store = make(src, shadow_dtype=torch.float16)
    assert torch.equal(store.shadow, store.param.to(torch.float16))
    store.copy_to(dst)
    for (name, a), (_, b) in zip(src.named_parameters(), dst.named_parameters()):
        assert torch.equal(a, b), name
    other = OddNet()
    store.load_from(other)
    for name, view in store.views(store.param).items():
        assert torch.equal(view, dict(other.named_parameters())[name].detach())
    with pytest.raises(ValueError, match="shape"):
        store.load_from(OddNet(sizes=[2, 7, 17, 4097, 1_000_003]))
    with pytest.raises(KeyError, match="no parameter named"):
        store.copy_to(torch.nn.Linear(2, 2))


def _small_pair(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))


def _with_meta_bias(model):
    model[1].bias = torch.nn.Parameter(torch.empty(2, device="meta"))
    return model


def _with_extra_head(model):
    model.append(torch.nn.Linear(2, 4))
    return model


def _with_sparse_bias(model):
    model[1].bias = torch.nn.Parameter(torch.zeros(2).to_sparse())
    return model


def _with_tied_weights(model):  # a model of the same names whose second layer's bias is its first's, in part
    return [(n, p) for n, p in model.named_parameters() if n != "1.bias"] + [("1.bias", model[0].bias[:2])]


def _with_expanded_bias(model):
    model[1].bias = torch.nn.Parameter(torch.zeros(1).expand(2))
    return model


def _with_inference_bias(model):
    with torch.inference_mode():
        model[1].bias = torch.nn.Parameter(torch.zeros(2))
    return model


@pytest.mark.parametrize("edit,error,message", [
    (_with_meta_bias, ValueError, r"parameter '1.bias' is a meta tensor \(no storage\)"),
    (_with_extra_head, ValueError, r"the model has trainable parameters the store does not hold: \['2.weight', "
                                   r"'2.bias'\] \(of 2\)"),
    (lambda m: [*m.named_parameters(), ("0.weight", torch.nn.Parameter(torch.zeros(5, 3)))], ValueError,
     "two different parameters are both named '0.weight'"),
    (lambda m: [("0.weight", m[0].weight), "0.bias"], TypeError, "an item of type str"),
    (_with_sparse_bias, ValueError, r"parameter '1.bias' is torch.sparse_coo, not a dense \(strided\) tensor"),
])
@pytest.mark.parametrize("method", ["load_from", "copy_to"])
def test_load_from_and_copy_to_refuse_a_model_unlike_the_stores_before_writing(edit, error, message, method):
    """A meta parameter failed half way through load_from (some weights written, the shadow stale) and copy_to
    into it did nothing without a word; a trainable parameter the store does not hold was left as it was; a name
    given twice kept the last tensor; a sparse parameter got torch's dense/sparse copy_ error."""
    _refuses_before_writing(edit, error, message, method)


@pytest.mark.parametrize("edit,message", [
    (_with_tied_weights, r"parameters '[01].bias' and '[01].bias' overlap in memory .* written twice"),
    (_with_expanded_bias, r"parameter '1.bias' is an expanded view"),
    (_with_inference_bias, r"parameter '1.bias' is an inference tensor"),
])
def test_copy_to_refuses_targets_it_cannot_write_each_apart_before_writing(edit, message):
    """copy_to into two views of one tensor wrote their shared elements twice, the last write winning, without a
    word; into an expanded view or an inference tensor it raised torch's error after the parameters before it were
    written."""
    _refuses_before_writing(edit, ValueError, message, "copy_to")


@pytest.mark.parametrize("method", ["load_from", "copy_to"])
def test_a_model_that_ties_what_the_store_holds_apart_is_refused_by_name(method):
    """Into (or from) a model that ties two parameters the store holds apart it said the model had no parameter of
    that name: named_parameters() names a tied tensor once."""
    torch.manual_seed(0)
    store = make(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    tied = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    before = tied[0].weight.clone()
    with pytest.raises(ValueError, match=rf"HostStore.{method}: the model ties parameters the store holds apart: "
                                         r"'1.weight' \(tied to '0.weight'\)"):
        getattr(store, method)(tied)
    assert torch.equal(tied[0].weight, before)


def _refuses_before_writing(edit, error, message, method):
    store = make(_small_pair(0), shadow_dtype=torch.bfloat16)
    model = _small_pair(1)
    target = edit(model)  # the model itself, edited, or a list of its (name, tensor) pairs and more
    if isinstance(target, torch.nn.Module):
        model = target
    before_store = {name: flat.clone() for name, flat in buffers(store).items()}
    def dense(t):
        return not t.is_meta and t.layout == torch.strided

    before_model = {name: t.clone() for name, t in model.named_parameters() if dense(t)}
    with pytest.raises(error, match=f"HostStore.{method}: .*{message}"):
        getattr(store, method)(target)
    assert all(torch.equal(flat, before_store[name]) for name, flat in buffers(store).items())
    assert all(torch.equal(t, before_model[name]) for name, t in model.named_parameters() if dense(t))


def test_load_from_and_copy_to_take_a_tied_parameter_under_either_name_and_skip_frozen_ones():
    source = _small_pair(0)
    store = make(source)
    target = _small_pair(1)
    target[1].weight.requires_grad_(False)  # frozen in the target: still written (the store holds it)
    extra_frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    store.copy_to([*target.named_parameters(), ("0.weight_alias", target[0].weight), ("frozen", extra_frozen)])
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), target.parameters()))
    assert torch.equal(extra_frozen, torch.ones(4))
    other = _small_pair(2)
    store.load_from([*other.named_parameters(), ("0.weight_alias", other[0].weight)])
    assert torch.equal(store.views(store.param)["0.weight"], other[0].weight.detach())


@pytest.mark.parametrize("dtypes,frozen,expected", [
    ([torch.bfloat16, torch.bfloat16], None, torch.bfloat16),
    ([torch.float16], None, torch.float16),
    ([torch.float32, torch.float32], None, None),
    ([torch.bfloat16, torch.float32], None, None),  # mixed: a 2-byte copy would round the float32 ones
    ([torch.bfloat16, torch.float16], None, None),
    ([torch.bfloat16], torch.float32, torch.bfloat16),  # frozen parameters are not in the store
    ([torch.float64], None, None),
])
def test_shadow_auto_takes_the_trainable_parameters_dtype(dtypes, frozen, expected):
    """shadow_dtype="auto" (the Engine's choice): a shadow of the replicas' own dtype when every trainable parameter
    has it, bfloat16 or float16, and none otherwise; the shadow holds the master weights rounded."""
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(5 + i, dtype=d)) for i, d in enumerate(dtypes))
    if frozen is not None:
        model.append(torch.nn.Parameter(torch.randn(3, dtype=frozen), requires_grad=False))
    assert store_module.replica_shadow_dtype(model) == expected
    store = make(model, shadow_dtype="auto")
    assert (store.shadow is None) == (expected is None)
    if expected is not None:
        assert store.shadow.dtype == expected and torch.equal(store.shadow, store.param.to(expected))
        assert store.layout == store_module.layout_of(model, shadow_dtype=expected)[0]


def test_refresh_shadow_rewrites_the_range_it_is_given():
    """Note [The shadow follows the master weights]: after a write of ``param`` outside the update, refresh_shadow
    rewrites the shadow's range from it, and only that range."""
    store = make(OddNet(sizes=[37, 100]), shadow_dtype=torch.bfloat16)
    before = store.shadow.clone()
    store.param.copy_(torch.randn(store.numel))
    store.refresh_shadow(10, 50)
    assert torch.equal(store.shadow[10:50], store.param[10:50].to(torch.bfloat16))
    assert torch.equal(store.shadow[:10], before[:10]) and torch.equal(store.shadow[50:], before[50:])
    store.refresh_shadow()
    assert torch.equal(store.shadow, store.param.to(torch.bfloat16))
    for lo, hi in [(-1, 5), (5, 4), (0, store.numel + 1), (0.5, 3)]:
        with pytest.raises(IndexError, match="refresh_shadow"):
            store.refresh_shadow(lo, hi)
    plain = make(OddNet(sizes=[5]))
    plain.refresh_shadow()  # no shadow: nothing to do
    assert plain.shadow is None
    with pytest.raises(IndexError, match="refresh_shadow"):  # a bad range is refused there too (it returned)
        plain.refresh_shadow(5, 2)
    with pytest.raises(ValueError, match="shadow_dtype must be None, 'auto' or one of"):
        make(OddNet(sizes=[5]), shadow_dtype="bfloat16")


def test_frozen_left_out_shared_once():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(11, 5)
            self.head = torch.nn.Linear(5, 11, bias=False)
            self.head.weight = self.emb.weight
            self.frozen = torch.nn.Linear(5, 3)
            self.frozen.requires_grad_(False)

    store = make(Tied())
    assert store.names == ["emb.weight"]
    assert store.numel == 64  # 55 elements padded to 16-element (64-byte) units
    named = [("a", torch.nn.Parameter(torch.randn(3))), ("b", torch.nn.Parameter(torch.randn(2)))]
    named.append(("a_again", named[0][1]))
    store = make(named)
    assert store.names == ["b", "a"]


def test_max_bytes_refusal_names_the_bytes():
    model = OddNet()
    needed = make(model, workers=2).nbytes
    assert make(model, workers=2, max_bytes=needed).nbytes == needed
    with pytest.raises(ValueError, match=rf"needs {needed} bytes.*max_bytes is {needed - 1}"):
        make(model, workers=2, max_bytes=needed - 1)
    # the most gradient slots: refused at once in a short message (a million took seconds and ran to 25 MB, a
    # list of every slot made first)
    with pytest.raises(ValueError, match=r"x \[param torch.float32, .*, 65536 x grad torch.float32\]") as refused:
        make(model, workers=65536, max_bytes=needed)
    assert len(str(refused.value)) < 500
    for bad in ("1000", 1e9, -1, True):
        with pytest.raises(ValueError, match=rf"max_bytes must be None or an int >= 0 \(bytes\); got {bad!r}"):
            make(model, workers=2, max_bytes=bad)


@pytest.mark.skipif(CUDA, reason="needs a machine without a usable CUDA device")
def test_pin_true_without_cuda_is_a_clear_error():
    model = OddNet()
    nbytes = make(model).nbytes
    with pytest.raises(RuntimeError, match=rf"pin=True asks for {nbytes} bytes.*pin=False"):
        pyengine.HostStore(model, pin=True)


@pytest.mark.skipif(CUDA, reason="needs a machine without a usable CUDA device")
def test_pin_auto_falls_back_and_warns_once(monkeypatch):
    monkeypatch.setattr(store_module, "_warned_unpinned", False)
    with pytest.warns(RuntimeWarning, match="pageable"):
        store = pyengine.HostStore(OddNet(sizes=[3]), pin="auto")
    assert store.pinned is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pyengine.HostStore(OddNet(sizes=[3]), pin="auto")


class _PinFails:
    """pyengine._C as a machine where CUDA is usable but cudaHostAlloc fails (host memory exhausted)."""

    def __getattr__(self, name):
        return getattr(pyengine._C, name)

    @staticmethod
    def _pinned_allocation_available():
        return True

    @staticmethod
    def _allocate_arena(nbytes, pinned):
        if pinned:
            raise RuntimeError(f"HostStore: cudaHostAlloc of {nbytes} bytes failed (out of memory); pass pin=False "
                               "for pageable memory")
        return pyengine._C._allocate_arena(nbytes, False)


def test_a_failed_pinned_allocation(monkeypatch):
    """pin=True: the allocation's error (bytes asked, the pin=False way out) reaches the caller; pin="auto": pageable
    memory, said once."""
    monkeypatch.setattr(store_module, "_C", _PinFails())
    monkeypatch.setattr(store_module, "_warned_unpinned", False)
    model = OddNet()
    nbytes = make(model).nbytes
    with pytest.raises(RuntimeError, match=rf"cudaHostAlloc of {nbytes} bytes failed.*pin=False"):
        pyengine.HostStore(model, pin=True)
    with pytest.warns(RuntimeWarning, match=r"pinned allocation failed \(HostStore: cudaHostAlloc.*pageable"):
        store = pyengine.HostStore(model, pin="auto")
    assert store.pinned is False and store.nbytes == nbytes
    store.param.fill_(1.5)  # the pageable arena is usable
    assert store.views(store.param)[store.names[0]].eq(1.5).all()


def test_argument_errors():
    model = OddNet(sizes=[5])
    with pytest.raises(ValueError, match="workers"):
        make(model, workers=0)
    with pytest.raises(ValueError, match="grad_dtype"):
        make(model, grad_dtype=torch.float64)
    with pytest.raises(ValueError, match="workers must be an int"):
        make(model, workers=True)
    with pytest.raises(ValueError, match=r"workers must be an int in \[1, 65536\]; got 1099511627776"):
        pyengine.HostStore([("w", torch.nn.Parameter(torch.empty(0)))], workers=2**40, pin=False)  # was killed
    assert make(model, workers=np.int64(3), max_bytes=np.int64(1 << 20)).workers == 3  # numpy's ints, as elsewhere
    with pytest.raises(ValueError, match=r"HostStore: parameter 'w' must be a dense \(strided\) tensor; got "
                                         "torch.sparse_coo"):
        pyengine.HostStore([("w", torch.nn.Parameter(torch.randn(3, 3).to_sparse()))], pin=False)
    with pytest.raises(ValueError, match=r"^HostStore: parameter '1.bias' is a meta tensor"):  # not "load_from"
        make(_with_meta_bias(_small_pair(0)))
    with pytest.raises(ValueError, match="both named 'w'"):
        pyengine.HostStore([("w", torch.nn.Parameter(torch.zeros(2))), ("w", torch.nn.Parameter(torch.zeros(3)))],
                           pin=False)
    for pin in ("yes", 1, None):
        with pytest.raises(ValueError, match="pin must be True, False or 'auto'"):
            make(model, pin=pin)
    with pytest.raises(ValueError, match="no trainable"):
        make(torch.nn.Linear(2, 2).requires_grad_(False))
    store = make(model, workers=2)
    with pytest.raises(IndexError, match=r"\[0, 2\)"):
        store.grad_slot(2)
    with pytest.raises(ValueError, match="1-D tensor"):
        store.views(torch.zeros(3))


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def test_pages_are_resident_at_creation():
    model = OddNet(sizes=[4 * 2**20])  # 16 MiB per buffer
    gc.collect()
    before = rss_bytes()
    store = make(model, workers=2)
    assert rss_bytes() - before >= 0.9 * store.nbytes  # faulted in at creation, not on first use


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def thp_fault_fallbacks() -> int:
    """How many huge-page faults the kernel has served with small pages so far (/proc/vmstat; 0 if unreadable)."""
    try:
        with open("/proc/vmstat") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("thp_fault_fallback ")), 0)
    except OSError:
        return 0


def test_the_arena_is_2mib_aligned_on_huge_pages():
    """The update streams the arena: on 4 KiB pages it ran 7-18 % slower (bench/RESULTS.md), so the arena starts on
    a 2 MiB boundary, huge pages advised (THP covers only whole aligned 2 MiB ranges)."""
    fallbacks = thp_fault_fallbacks()
    store = make(OddNet(sizes=[4 * 2**20]), workers=1)  # 16 MiB per buffer, 64 MiB in all
    base = store.param.untyped_storage().data_ptr()
    assert base % (2 << 20) == 0
    if thp_mode() == "never":
        pytest.skip("transparent huge pages are disabled on this machine")
    huge = store_module.huge_page_bytes(base)
    if huge < 2 << 20 and thp_fault_fallbacks() > fallbacks:  # asked for, but no free 2 MiB page (fragmentation)
        pytest.skip("the kernel had no free huge page: its faults fell back to 4 KiB pages (thp_fault_fallback)")
    assert huge >= 2 << 20


@pytest.mark.parametrize("numel,workers,stagger,offsets", [(2**25, 4, 640, 7), (2**19, 1, 1344, 4),
                                                           (2**25 + 2**17, 4, 0, 4), (2**19 + 16, 8, 0, 11)])
def test_buffers_sharing_their_huge_page_offset_are_staggered(numel, workers, stagger, offsets):
    """Note [Staggered sections]: buffers whose size is a multiple of 2 MiB would all start at the same offset within
    their huge pages (the update then ran 1.2-1.5x slower): they are set a stagger apart, all of it within a page;
    other sizes keep the buffers back to back (2**25 + 2**17 floats: starts at four offsets within 2 MiB)."""
    store = make([("w", torch.nn.Parameter(torch.zeros(numel)))], workers=workers)
    flats = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in buffers(store).values())
    assert [b[0] - a[1] for a, b in zip(flats, flats[1:])] == [stagger] * (len(flats) - 1)
    assert len({start % (2 << 20) for start, _ in flats}) == offsets
    assert stagger * (len(flats) - 1) <= PAGE and stagger % 64 == 0
    assert store.nbytes == sum(b - a for a, b in flats) + stagger * (len(flats) - 1)
    assert store_module.section_stagger([2 << 20] * 2) == 2048 and store_module.section_stagger([4096, 64]) == 0
    assert store_module.section_stagger([1 << 20] * 5) == 0  # two offsets: measured fine as it is
    assert store_module.section_stagger([0] * 5) == 0 and store_module.section_stagger([2 << 20, 0, 0]) == 0


def test_views_outlive_the_store():
    model = OddNet()
    store = make(model, workers=2)
    param, slot, expect = store.param, store.grad_slot(1), store.param.clone()
    views = store.views(store.exp_avg)
    del store
    gc.collect()
    junk = [torch.randn(1_000_000) for _ in range(8)]  # reuse freed memory if the arena had been freed
    assert torch.equal(param, expect)
    slot.fill_(2.0)
    for view in views.values():
        view.fill_(3.0)
    assert torch.all(slot == 2.0) and all(torch.all(v == 3.0) for v in views.values())
    del junk


def vm_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def test_the_arena_is_mapped_at_its_exact_size():
    """One arena of exactly ``nbytes`` (rounded up to a page): the address space the store adds is measured, so an
    allocator that rounds a block up (to a power of two, as torch's caching pinned allocator does) would show.
    nbytes here is just above 2^27."""
    n = (2**27 + 2**20) // 16  # param, exp_avg, exp_avg_sq and one fp32 slot: 16 bytes an element
    named = [("w", torch.nn.Parameter(torch.zeros(n)))]
    make(OddNet(sizes=[5]))  # the first store starts the threads that touch pages (their stacks, arenas)
    gc.collect()
    before = vm_bytes()
    store = make(named)
    grown = vm_bytes() - before
    assert 2**27 < store.nbytes <= 2**27 + 2**20 + PAGE
    assert store.nbytes <= grown <= store.nbytes + 4 * 2**20, (store.nbytes, grown)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_failed_pinned_allocation_names_the_bytes_and_the_fallback():
    """cudaHostAlloc's own failure (not a stand-in): the error says how many bytes were asked and that pin=False is
    the fallback; nothing is left allocated."""
    from pyengine import _C
    with pytest.raises(RuntimeError, match=r"cudaHostAlloc of 1125899906842624 bytes .*pass pin=False"):
        _C._allocate_arena(2**50, True, huge_pages=False)
    store = pyengine.HostStore(OddNet(sizes=[5]), pin=True)  # the next allocation still works
    assert store.pinned


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_views_of_a_pinned_store_outlive_it():
    store = pyengine.HostStore(OddNet(), workers=2, pin=True)
    param, slot, expect = store.param, store.grad_slot(1), store.param.clone()
    del store
    gc.collect()
    junk = [torch.empty(1_000_000, pin_memory=True).fill_(9.0) for _ in range(8)]
    assert torch.equal(param, expect) and param.is_pinned()
    gpu = param.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(gpu.cpu(), expect)
    slot.fill_(2.0)
    assert torch.all(slot == 2.0)
    del junk


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_pinned_store_on_cuda():
    store = pyengine.HostStore(OddNet(), workers=2, pin=True)
    assert store.pinned and store.param.is_pinned() and store.grad_slot(1).is_pinned()
    assert store.param.untyped_storage().nbytes() == store.nbytes
    gpu = store.param.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(gpu.cpu(), store.param)
    # Pinned on huge pages (mapped, THP-advised, then cudaHostRegister), and cudaHostAlloc's path as the fallback.
    big = pyengine.HostStore(OddNet(sizes=[4 * 2**20]), workers=1, pin=True)
    base = big.param.untyped_storage().data_ptr()
    assert big.pinned and big.param.is_pinned() and base % (2 << 20) == 0
    if thp_mode() != "never":
        assert store_module.huge_page_bytes(base) >= 2 << 20
    plain = pyengine._C._allocate_arena(3 << 20, True, huge_pages=False)
    assert plain.is_pinned() and plain.numel() == 3 << 20 and torch.count_nonzero(plain) == 0
    src = torch.randn(big.numel, device="cuda")
    big.param.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(big.param, src.cpu())


# ---- partial Adam state (state_ranges): the sharded update's store -------------------------------------------------

def random_ranges(rng, numel, count):
    """``count`` increasing, disjoint ranges at random cut points of [0, numel), the first one empty."""
    cuts = sorted(torch.randint(0, numel + 1, (2 * count,), generator=rng).tolist())
    ranges = [(cuts[2 * i], cuts[2 * i + 1]) for i in range(count)]
    return [(ranges[0][0], ranges[0][0])] + ranges[1:]


def padded16(n):
    return -(-n // 16) * 16


@pytest.mark.parametrize("amsgrad,shadow_dtype,workers", [(False, None, 1), (True, torch.bfloat16, 3)])
def test_state_ranges_pack_the_adam_state(rng, amsgrad, shadow_dtype, workers):
    model = OddNet(sizes=[1, 7, 17, 4097, 10_001])
    full = make(model, workers=workers, amsgrad=amsgrad, shadow_dtype=shadow_dtype)
    assert full.state_ranges is None and full.state_numel == full.numel
    assert full.state_slice(3, 20) == slice(3, 20)
    ranges = random_ranges(rng, full.numel, 5)
    store = make(model, workers=workers, amsgrad=amsgrad, shadow_dtype=shadow_dtype, state_ranges=ranges)
    held = sum(hi - lo for lo, hi in ranges)
    assert store.state_ranges == tuple(ranges) and store.state_numel == held
    # nbytes: the Adam state shrinks to the held elements (padded to 64 bytes), the rest stays as in the full store
    state_buffers = 3 if amsgrad else 2
    assert store.nbytes == full.nbytes - 4 * state_buffers * (full.numel - padded16(held))
    assert store.param.untyped_storage().nbytes() == store.nbytes
    bufs = buffers(store)
    for name, flat in bufs.items():
        assert flat.numel() == (held if name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") else store.numel), name
        assert flat.data_ptr() % 64 == 0, name
    spans = sorted((f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in bufs.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    # load_state_from_full keeps the held ranges; state_slice finds them, whole or in part
    source = torch.randn(store.numel, generator=rng)
    store.load_state_from_full(store.exp_avg_sq, source)
    at = 0
    for lo, hi in ranges:
        assert store.state_slice(lo, hi) == slice(at, at + hi - lo)
        assert torch.equal(store.exp_avg_sq[store.state_slice(lo, hi)], source[lo:hi])
        if hi - lo >= 3:
            inner = store.state_slice(lo + 1, hi - 1)
            assert torch.equal(store.exp_avg_sq[inner], source[lo + 1:hi - 1])
        at += hi - lo
    assert torch.count_nonzero(store.exp_avg) == 0
    lo, hi = ranges[-1]
    with pytest.raises(IndexError, match="not inside one of the held state ranges"):
        store.state_slice(lo, hi + 1) if hi < store.numel else store.state_slice(lo - 1, hi)
    with pytest.raises(IndexError, match=r"0 <= lo <= hi"):
        store.state_slice(5, 4)
    with pytest.raises(ValueError, match="full must be a 1-D tensor"):
        store.load_state_from_full(store.exp_avg, torch.zeros(3))


def test_state_slice_below_the_first_held_range_is_an_index_error():
    """Elements below the first held range got a slice of negative start (the last elements of the packed state),
    not the IndexError the docstring promises."""
    store = make(OddNet(sizes=[7, 17, 4097]), state_ranges=[(64, 80), (100, 130)])
    assert store.state_slice(64, 80) == slice(0, 16) and store.state_slice(110, 120) == slice(26, 36)
    for lo, hi in ((0, 5), (63, 64), (70, 90), (80, 100)):
        with pytest.raises(IndexError, match="not inside one of the held state ranges"):
            store.state_slice(lo, hi)


def test_state_ranges_update_equals_the_full_store_on_the_held_ranges(rng):
    """The fused update on packed slices gives the same bits as on the full store, range by range."""
    model = OddNet(sizes=[7, 17, 4097])
    full = make(model, amsgrad=True)
    ranges = random_ranges(rng, full.numel, 4)
    part = make(model, amsgrad=True, state_ranges=ranges)
    grads = [torch.randn(full.numel, generator=rng) for _ in range(3)]
    for step, grad in enumerate(grads, start=1):
        kw = dict(lr=1e-2, step=step, weight_decay=0.1, amsgrad=True)
        pyengine.ops.mean_grad_adamw_(full.param, full.exp_avg, full.exp_avg_sq, [grad],
                                      max_exp_avg_sq=full.max_exp_avg_sq, **kw)
        for lo, hi in ranges:
            s = part.state_slice(lo, hi)
            if hi > lo:
                pyengine.ops.mean_grad_adamw_(part.param[lo:hi], part.exp_avg[s], part.exp_avg_sq[s], [grad[lo:hi]],
                                              max_exp_avg_sq=part.max_exp_avg_sq[s], **kw)
    for lo, hi in ranges:
        s = part.state_slice(lo, hi)
        assert torch.equal(part.param[lo:hi], full.param[lo:hi])
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert torch.equal(getattr(part, name)[s], getattr(full, name)[lo:hi]), name


def test_state_ranges_torch_state_dict_needs_the_full_state(rng):
    model = OddNet(sizes=[7, 17])
    full = make(model)
    for flat in (full.exp_avg, full.exp_avg_sq):  # parameter elements only: padding is zero in every state
        for view in full.views(flat).values():
            view.copy_(torch.rand(view.shape, generator=rng))
    names = [n for n, _ in model.named_parameters()]
    opt = pyengine.AdamW()
    sd = opt.torch_state_dict(full, 4, names)
    part = make(model, state_ranges=[(0, 5), (9, full.numel - 3)])
    assert opt.load_torch_state_dict(part, sd, names) == 4
    for lo, hi in part.state_ranges:
        assert torch.equal(part.exp_avg[part.state_slice(lo, hi)], full.exp_avg[lo:hi])
        assert torch.equal(part.exp_avg_sq[part.state_slice(lo, hi)], full.exp_avg_sq[lo:hi])
    with pytest.raises(ValueError, match="part of the Adam state only.*full_state"):
        opt.torch_state_dict(part, 4, names)
    again = opt.torch_state_dict(part, 4, names, {"exp_avg": full.exp_avg, "exp_avg_sq": full.exp_avg_sq})
    for i, state in sd["state"].items():
        assert torch.equal(again["state"][i]["exp_avg"], state["exp_avg"])


def test_state_ranges_empty_and_budget():
    model = OddNet(sizes=[7, 17])
    full = make(model, workers=2)
    none = make(model, workers=2, state_ranges=[])
    assert none.state_numel == 0 and none.exp_avg.numel() == 0
    assert none.nbytes == 4 * none.numel * 3  # param + 2 gradient slots
    empties = make(model, workers=2, state_ranges=[(0, 0), (5, 5), (full.numel, full.numel)])
    assert empties.nbytes == none.nbytes and empties.state_slice(5, 5) == slice(0, 0)
    ranges = [(1, 8), (16, 33)]
    needed = make(model, workers=2, state_ranges=ranges).nbytes
    assert needed == full.nbytes - 8 * (full.numel - 32)
    with pytest.raises(ValueError, match=rf"needs {needed} bytes.*Adam state 24 elements.*max_bytes is {needed - 1}"):
        make(model, workers=2, state_ranges=ranges, max_bytes=needed - 1)


def test_state_ranges_state_slice_and_refresh_shadow_take_numpys_ints():
    """grad_slot, wait and copy_back took numpy's ints; state_ranges, state_slice and refresh_shadow said "must be
    a pair of ints" / "expected ints" of np.int64 (a range computed with numpy, say)."""
    model = OddNet(sizes=[7, 9])
    store = make(model, shadow_dtype=torch.bfloat16, state_ranges=[(np.int64(0), np.int64(8)), (16, np.int32(20))])
    assert store.state_ranges == ((0, 8), (16, 20)) and all(type(v) is int for r in store.state_ranges for v in r)
    assert store.state_slice(np.int64(16), np.int64(18)) == slice(8, 10)
    store.param[3:5].fill_(2.0)
    store.refresh_shadow(np.int64(3), np.int64(5))
    assert store.shadow[3:5].eq(2.0).all() and store.shadow[5] != 2.0
    with pytest.raises(IndexError, match="expected ints"):
        store.state_slice(np.float64(1.0), 3)


@pytest.mark.parametrize("ranges,message", [
    (5, "sequence of \\(lo, hi\\) pairs; got int"),
    ([(0, 3, 5)], r"state_ranges\[0\] must be a pair of ints"),
    ([(0, 2.0)], r"state_ranges\[0\] must be a pair of ints"),
    ([(False, 2)], r"state_ranges\[0\] must be a pair of ints"),
    ([(0, 4), (3, 9)], r"state_ranges\[1\] = \(3, 9\) starts before the previous range ends \(4\)"),
    ([(6, 9), (0, 2)], "increasing and disjoint"),
    ([(5, 2)], r"0 <= lo <= hi <= numel"),
    ([(-1, 2)], r"0 <= lo <= hi <= numel"),
    ([(0, 10**9)], r"0 <= lo <= hi <= numel = 176"),  # 16 + 16 + 144 (the 13 x 11 matrix)
])
def test_state_ranges_errors(ranges, message):
    with pytest.raises(ValueError, match=message):
        make(OddNet(sizes=[7, 9]), state_ranges=ranges)


@pytest.mark.parametrize("call,error,message", [
    (lambda m: make(m, amsgrad="no"), TypeError, "HostStore: amsgrad must be True or False; got str 'no'"),
    (lambda m: make(m, amsgrad=1), TypeError, "HostStore: amsgrad must be True or False; got int 1"),
    (lambda m: make(m).views([0.0] * make(m).numel), TypeError, r"HostStore.views: expected a 1-D tensor of \d+ "
                                                                 "elements; got list"),
])
def test_store_refuses_a_switch_or_a_buffer_of_another_type(call, error, message):
    """amsgrad="no" was truthy (a max_exp_avg_sq buffer nobody asked for); views(list) raised AttributeError."""
    with pytest.raises(error, match=message):
        call(OddNet(sizes=[3, 5]))


def _torch_adamw_state(model, amsgrad=False):
    """A real torch.optim.AdamW's state_dict after one step of ``model``."""
    opt = torch.optim.AdamW(model.parameters(), amsgrad=amsgrad)
    sum(p.square().sum() for p in model.parameters()).backward()
    opt.step()
    return opt.state_dict()


@pytest.mark.parametrize("edit,message", [
    (None, r"state\[0\] \(param 'mat'\) has max_exp_avg_sq \(saved with amsgrad=True\); .*AdamW\(amsgrad=True\)"),
    (lambda e: e.update(step="1"), r"state\[0\]\['step'\] \(param 'mat'\) must be a number or a one-element tensor"),
    (lambda e: e.update(step=torch.tensor(True)), r"state\[0\]\['step'\] .* must be a number"),
    (lambda e: e.update(step=True), r"state\[0\]\['step'\] .* must be a number"),
])
def test_load_torch_state_dict_refuses_state_it_would_drop_or_misread(edit, message):
    """An amsgrad=True state loaded into a store without max_exp_avg_sq dropped that buffer without a word; a step
    given as the string "1" or a bool was read as a number."""
    model = OddNet(sizes=[3, 5])
    names = [n for n, _ in model.named_parameters()]
    sd = _torch_adamw_state(model, amsgrad=edit is None)
    if edit is not None:
        edit(sd["state"][0])
    store = make(model)
    before = {name: flat.clone() for name, flat in buffers(store).items()}
    with pytest.raises(ValueError, match=message):
        pyengine.AdamW().load_torch_state_dict(store, sd, names)
    assert all(torch.equal(flat, before[name]) for name, flat in buffers(store).items())
    assert pyengine.AdamW().load_torch_state_dict(store, _torch_adamw_state(model), names) == 1  # a good one loads


def test_load_torch_state_dict_warns_of_group_settings_it_does_not_read():
    """A torch.optim state whose groups hold other hyper-parameters loads its moments; the groups' values are not
    read (the AdamW's drive the update), and the warning names them."""
    model = OddNet(sizes=[3, 5])
    names = [n for n, _ in model.named_parameters()]
    sd = _torch_adamw_state(model)
    sd["param_groups"][0].update(lr=0.5, maximize=True)
    with pytest.warns(UserWarning, match=r"param_groups hold \{\"param_groups\[0\]\['lr'\]\": 0\.5, "
                                         r"\"param_groups\[0\]\['maximize'\]\": True\}; they are not read"):
        assert pyengine.AdamW().load_torch_state_dict(make(model), sd, names) == 1


def _named_torch_state(model, order, no_decay=None, prefix=""):
    """A torch.optim.AdamW built from named parameters (torch >= 2.6 then saves param_names), in ``order`` (indices
    into model.named_parameters()), after one step; with ``no_decay``, two groups as AdamW(no_decay=...) lays them."""
    named = [(prefix + n, p) for n, p in model.named_parameters()]
    if no_decay is None:
        groups = [{"params": [named[i] for i in order]}]
    else:
        groups = [{"params": [named[i] for i in order if no_decay not in named[i][0]]},
                  {"params": [named[i] for i in order if no_decay in named[i][0]], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups)
    sum((k + 1) * p.square().sum() for k, (_, p) in enumerate(named)).backward()  # each parameter its own moments
    opt.step()
    return opt.state_dict()


@pytest.mark.parametrize("no_decay", [None, "ps"])
def test_a_torch_state_whose_param_names_put_another_parameter_at_an_index_is_refused(no_decay):
    """torch >= 2.6 saves param_names for an optimizer built from named_parameters(); torch loads by index and never
    reads them. A state of such an optimizer built over the parameters in another order loaded each moment into
    another parameter of the same shape, without a word; it is refused, naming the index, and nothing is written.
    The same optimizer in model order loads (each moment to its parameter), and names that are none of the model's
    (a wrapper's "module." prefix) load by index, as in torch."""
    model = OddNet(sizes=[5, 5, 5])  # mat, then ps.0, ps.1, ps.2 of one shape
    names = [n for n, _ in model.named_parameters()]
    adamw = pyengine.AdamW(no_decay=() if no_decay is None else (no_decay,))
    store = make(model)
    before = {name: flat.clone() for name, flat in buffers(store).items()}
    permuted = _named_torch_state(model, [0, 1, 3, 2], no_decay)  # ps.1 and ps.2 swapped
    assert "param_names" in permuted["param_groups"][0]
    group = 0 if no_decay is None else 1
    with pytest.raises(ValueError, match=rf"param_groups\[{group}\]\['param_names'\]\[\d\] is 'ps.2' where this "
                                         r"model's order puts 'ps.1'.*another order.*nothing was loaded"):
        adamw.load_torch_state_dict(store, permuted, names)
    assert all(torch.equal(flat, before[name]) for name, flat in buffers(store).items())
    for prefix in ("", "module."):
        sd = _named_torch_state(model, [0, 1, 2, 3], no_decay, prefix=prefix)
        assert adamw.load_torch_state_dict(store, sd, names) == 1
        torch_order = [n for group_names, _ in adamw.param_groups(names) for n in group_names]
        views = store.views(store.exp_avg_sq)
        for index, name in enumerate(torch_order):
            assert torch.equal(views[name], sd["state"][index]["exp_avg_sq"]), (prefix, name)
    bad = _named_torch_state(model, [0, 1, 2, 3], no_decay)
    bad["param_groups"][0]["param_names"] = bad["param_groups"][0]["param_names"][:-1]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['param_names'\] must be a list of \d names"):
        adamw.load_torch_state_dict(store, bad, names)


def test_a_torch_state_over_frozen_parameters_too_says_to_leave_them_out():
    """torch.optim.AdamW(model.parameters()) keeps frozen parameters in its group; the engine's layout has the
    trainable ones only. The refusal said the indices differ; it now says why and what to build instead."""
    model = OddNet(sizes=[3, 5])
    model.ps[0].requires_grad_(False)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    sd = _torch_adamw_state(model)
    with pytest.raises(ValueError, match=r"holds params \[0, 1, 2\]; expected 2 params .*holds the frozen parameters "
                                         r"too: build it over the trainable ones"):
        pyengine.AdamW().load_torch_state_dict(make(model), sd, names)


@pytest.mark.parametrize("ranges", [None, [(0, 5), (9, 20)]])
def test_loading_a_state_saved_before_any_update_zeroes_the_moments(ranges):
    """A torch optimizer that never stepped has an empty state (step 0): loading it into a used store kept the
    store's moments, and the next update (step 1) ran on them. As torch's own optimizer would: zeros."""
    model = OddNet(sizes=[3, 5])
    names = [n for n, _ in model.named_parameters()]
    store = make(model, amsgrad=True, state_ranges=ranges)
    for flat in (store.exp_avg, store.exp_avg_sq, store.max_exp_avg_sq):
        flat.fill_(5.0)
    fresh = torch.optim.AdamW(model.parameters(), amsgrad=True).state_dict()
    assert pyengine.AdamW(amsgrad=True).load_torch_state_dict(store, fresh, names) == 0
    for flat in (store.exp_avg, store.exp_avg_sq, store.max_exp_avg_sq):
        assert flat.numel() > 0 and not flat.any()


def test_torch_state_dict_holds_step_counts_past_float32s_exact_range():
    """The step was a float32 tensor, exact up to 2**24 only: a state taken after 2**24 + 1 updates read back as
    2**24, and the engine refused its own state ("optimizer step 16777216 does not match the state's version")."""
    model = OddNet(sizes=[3, 5])
    names = [n for n, _ in model.named_parameters()]
    store, adamw = make(model), pyengine.AdamW()
    for step in (2**24 - 1, 2**24 + 1, 10**8 + 7, 2**53):
        assert adamw.load_torch_state_dict(store, adamw.torch_state_dict(store, step, names), names) == step


@pytest.mark.parametrize("step", [-1, 1.5, True, "3"])
def test_torch_state_dict_refuses_a_step_that_is_no_count(step):
    """step=-1 gave an empty state, 1.5 a state at step 1.5, True one at step 1."""
    model = OddNet(sizes=[3])
    with pytest.raises(ValueError, match="torch_state_dict: step must be an int >= 0"):
        pyengine.AdamW().torch_state_dict(make(model), step, [n for n, _ in model.named_parameters()])


def test_a_store_of_parameters_that_overlap_in_memory_is_refused():
    """Two parameters over shared elements (views of one tensor) would get master weights apart: refused naming
    both (the engine checks its frozen parameters too); views apart are fine."""
    base = torch.randn(8)
    a, b = torch.nn.Parameter(base[:4]), torch.nn.Parameter(base[3:6])
    with pytest.raises(ValueError, match=r"parameters 'a' and 'b' overlap in memory"):
        pyengine.HostStore([("a", a), ("b", b)], pin=False)
    store = pyengine.HostStore([("a", a), ("b", torch.nn.Parameter(base[4:8]))], pin=False)
    assert sorted(store.names) == ["a", "b"]  # held in reverse
