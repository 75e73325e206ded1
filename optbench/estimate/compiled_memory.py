"""What a compiled step (``compile=``) keeps for backward, traced without Inductor's codegen.

``torch.compile`` hands each block to AOTAutograd, which traces the forward and backward together
(the joint graph, with Inductor's decompositions) and lets the min-cut partitioner choose what the
forward saves: often less than eager (cheap ops are recomputed in the backward instead), and for
float8 the 8-bit casts rather than the high-precision inputs. Inductor then generates kernels for
the two graphs; the saved set does not change, and the buffers inside a fused kernel never exist.

``use_compiled_blocks`` replaces the forward of every block of the fake model (inside its
checkpoint wrapper, if any) by that AOTAutograd compilation, with graphs that run op by op on the
FakeTensors: the trace then allocates and saves what the compiled step saves. Each distinct input
layout (micro-batch, autocast) is compiled once, outside the memory tracker (``_untracked``), and
run under it. The graphs run as Inductor's generated code runs them (``_Fused``):
- an op Inductor would fuse into a kernel runs untracked (its result never exists in memory), and
  what it reads is held until that result's last use, where the kernel it is fused into reads it;
- materialized pointwise results that read a value in common are one kernel, run once all its
  inputs are ready, so its results are live together (``kernel_order``);
- a result that alone reads an input of its size, which dies there, is written over it
  (``in_place``).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree


def use_compiled_blocks(blocks: nn.Module) -> int:
    """Give every block of ``blocks`` (the decoder's block container) its AOTAutograd-compiled forward; returns
    how many. A checkpointed block is compiled as torch.compile compiles it: one graph whose
    forward ops are all tagged for recomputation (Dynamo's ``tag_activation_checkpoint``), so the
    forward saves the block's inputs and the backward graph recomputes what it needs, in place of
    the eager checkpoint wrapper."""
    children = list(blocks.children())  # a ModuleDict (optbench's) or a ModuleList (transformers')
    for block in children:
        inner = getattr(block, "_checkpoint_wrapped_module", None)
        if inner is None:
            block.forward = _Compiled(block, block.forward, recompute=False)
        else:
            block.forward = _Compiled(block, inner.forward, recompute=True)
    return len(children)


def _key(args: tuple, kwargs: dict) -> tuple:
    """What a compiled graph depends on: the layouts of the tensors among the arguments (keyword
    arguments' nested tuples too: transformers' blocks take ``position_embeddings=(cos, sin)``), the
    other arguments' values, autocast and grad mode."""
    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), tuple(value.stride()), value.dtype, value.requires_grad)
        return value

    leaves, spec = pytree.tree_flatten((args, kwargs))
    autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    return tuple(one(v) for v in leaves), str(spec), autocast, torch.is_grad_enabled()


class _Compiled:
    """A module's forward through AOTAutograd (min-cut partitioner, graphs run as traced)."""

    def __init__(self, module: nn.Module, original: Any, *, recompute: bool) -> None:
        self.module, self.original, self.recompute = module, original, recompute
        self.compiled: dict[tuple, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is saved without autograd: the eager ops
            return self.original(*args, **kwargs)
        key = _key(args, kwargs)
        params = dict(self.module.named_parameters())
        # every tensor is an input of the graph, keyword arguments' too (a tensor closed over would be
        # a constant of another fake mode); the rest of the keyword arguments is fixed per graph
        leaves, spec = pytree.tree_flatten(kwargs)
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        inputs = (*args, *(leaves[i] for i in where))
        if key not in self.compiled:
            # AOTAutograd traces at the first call: make it here, untracked, its result dropped (and
            # what it saves kept from an enclosing checkpoint, which would count it as the block's)
            with _untracked(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                self.compiled[key] = self._compile(len(args), leaves=leaves, where=where, spec=spec)
                self.compiled[key](params, *inputs)
        return self.compiled[key](params, *inputs)

    def _compile(self, positional: int, *, leaves: list, where: list[int], spec: Any) -> Any:
        from functorch.compile import aot_function
        from torch._inductor.compile_fx import partition_fn
        from torch._inductor.decomposition import select_decomp_table
        from torch.nn.utils.stateless import _reparametrize_module

        module, original = self.module, self.original
        fixed = [None if i in where else leaf for i, leaf in enumerate(leaves)]

        def step(params: dict, *inputs: Any) -> Any:
            filled = list(fixed)
            for i, tensor in zip(where, inputs[positional:], strict=True):
                filled[i] = tensor
            with _reparametrize_module(module, params):
                return original(*inputs[:positional], **pytree.tree_unflatten(filled, spec))

        def as_traced(graph: torch.fx.GraphModule, _inputs: Any) -> Any:
            return _Fused(graph).boxed()

        return aot_function(step, fw_compiler=as_traced, bw_compiler=as_traced,
                            partition_fn=_recomputing(partition_fn) if self.recompute else partition_fn,
                            decompositions=select_decomp_table())


def _recomputing(partition: Any) -> Any:
    """``partition`` of a joint graph whose forward ops are tagged for recomputation, as Dynamo
    tags a checkpointed region (the partitioner then saves the region's inputs only)."""
    from torch.utils.checkpoint import CheckpointPolicy

    def tagged(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        backward = {n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")}
        for node in joint.graph.nodes:
            if any(i in backward for i in node.all_input_nodes):
                backward.add(node)
            elif node.op == "call_function":
                node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
                node.meta["ac_graph_id"] = 1
        return partition(joint, joint_inputs, **kwargs)

    return tagged


# ------------------------------------------------------------------------------ fused kernels
_FUSED = threading.local()
POINTWISE_EXTRA = ("_to_copy", "convert_element_type", "full", "scalar_tensor", "zeros", "ones", "empty")


def in_fused_kernel() -> bool:
    """True while a compiled graph runs an op Inductor would fuse into a kernel: its result is an
    intermediate no allocator ever sees (the memory tracker lets it through untracked)."""
    return getattr(_FUSED, "active", False)


def _complex(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_complex()


def _kind(node: torch.fx.Node) -> str:
    """view | pointwise | reduction | extern (a kernel of its own: matmuls, attention, fallbacks;
    Inductor generates no code for complex tensors, so an op on one falls back to aten)."""
    import operator

    target = node.target
    if target is operator.getitem:  # one result of a multi-output op: no allocation of its own
        return "view"
    if not isinstance(target, torch._ops.OpOverload):  # a higher-order op (random ops the partitioner
        return "extern"  # wrapped in RNG-state bookkeeping) runs its op as a kernel of its own
    if target.is_view:
        return "view"
    if _complex(node) or any(_complex(n) for n in node.all_input_nodes):
        return "extern"
    if torch.Tag.reduction in target.tags:
        return "reduction"
    if torch.Tag.pointwise in target.tags or target.overloadpacket.__name__ in POINTWISE_EXTRA:
        return "pointwise"
    return "extern"


def materialized(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes whose results Inductor writes to memory: extern kernels' and reductions' outputs,
    the graph's outputs (the forward's saved tensors included), and what an extern kernel reads
    (through views: their base). Pointwise results consumed only by other fused ops stay in
    registers."""
    kinds = {node: _kind(node) for node in graph.nodes if node.op == "call_function"}
    needed = {n for n in kinds if kinds[n] in ("extern", "reduction")}
    for node in graph.nodes:
        if node.op == "output":
            needed |= {n for n in node.all_input_nodes if n in kinds}
        elif kinds.get(node) == "extern":
            needed |= {n for n in node.all_input_nodes if n in kinds}

    for node in reversed(list(graph.nodes)):  # a needed view needs its base
        if node in needed and kinds.get(node) == "view":
            needed |= {n for n in node.all_input_nodes if n in kinds}
    return needed


def kernel_order(graph: torch.fx.Graph, kept: set[torch.fx.Node]) -> dict[torch.fx.Node, set[torch.fx.Node]]:
    """Reorder ``graph`` as Inductor runs it: materialized pointwise results of one size that read a
    materialized value in common, with no path between them, are one kernel (horizontal fusion).
    The kernel runs once all of its inputs are ready, and its outputs then exist at once: SwiGLU's
    backward writes the gate's and the up projection's gradients and the activation for the down
    projection's weight gradient in one kernel, so the three are live together. Each kernel takes
    the fused ops it computes in registers (its members' unmaterialized inputs) along; everything
    else keeps its order as far as the kernels allow. Returns each materialized pointwise node's
    kernel: the nodes it computes."""
    nodes = list(graph.nodes)
    groups = _horizontal_kernels(nodes, kept)
    kernels = {node: group for group in groups for node in group if node in kept}
    fused = [group for group in groups if len(group & kept) > 1]
    if not fused:
        return kernels
    unit_of: dict[torch.fx.Node, Any] = {node: ("n", node) for node in nodes}
    for index, group in enumerate(fused):
        unit_of.update(dict.fromkeys(group, ("g", index)))
    order = _schedule(nodes, unit_of)
    if order is None:  # a cycle through the merged kernels: keep the graph's own order
        return kernels
    for before, node in zip(order[:-1], order[1:], strict=True):
        before.append(node)
    graph.lint()
    return kernels


def _horizontal_kernels(nodes: list[torch.fx.Node], kept: set[torch.fx.Node]) -> list[set[torch.fx.Node]]:
    """The kernels of ``kernel_order``: each materialized pointwise node with the fused ops it
    computes, merged with the earlier ones of its size that share a read, where no path leaves
    the merged kernel and comes back into it."""
    kinds = {node: _kind(node) for node in nodes if node.op == "call_function"}

    def cone(node: torch.fx.Node) -> set[torch.fx.Node]:  # the node and the fused ops it computes
        out, stack = {node}, [node]
        while stack:
            for i in stack.pop().all_input_nodes:
                if i not in out and i in kinds and i not in kept:
                    out.add(i)
                    stack.append(i)
        return out

    def reads(members: set[torch.fx.Node]) -> set[torch.fx.Node]:
        return {i for n in members for i in n.all_input_nodes if i not in members}

    def numel(node: torch.fx.Node) -> int | None:
        value = node.meta.get("val")
        return value.numel() if isinstance(value, torch.Tensor) else None

    ancestors: dict[torch.fx.Node, set[torch.fx.Node]] = {}
    for node in nodes:
        ancestors[node] = set().union(*({i} | ancestors[i] for i in node.all_input_nodes))
    groups: list[tuple[int | None, set[torch.fx.Node]]] = []
    for node in (n for n in nodes if n in kept and kinds.get(n) == "pointwise" and numel(n)):
        mine = cone(node)
        for size, members in groups:
            if size != numel(node) or not reads(mine) & reads(members):
                continue
            unit = members | mine
            if any(ancestors[x] & unit for x in set().union(*(ancestors[n] for n in unit)) - unit):
                continue  # a path leaves the kernel and comes back
            members |= mine
            break
        else:
            groups.append((numel(node), mine))
    return [members for _, members in groups]


def _schedule(nodes: list[torch.fx.Node], unit_of: dict[torch.fx.Node, Any]) -> list[torch.fx.Node] | None:
    """The nodes in a topological order of their units (a kernel's nodes together), each unit as
    early as its first node was in ``nodes`` once its inputs are ready; None if the units form a cycle."""
    import heapq

    position = {node: i for i, node in enumerate(nodes)}
    units: dict[Any, list[torch.fx.Node]] = collections.defaultdict(list)
    for node in nodes:
        units[unit_of[node]].append(node)
    needs = {u: {unit_of[i] for n in ms for i in n.all_input_nodes} - {u} for u, ms in units.items()}
    users: dict[Any, set] = collections.defaultdict(set)
    for unit, inputs in needs.items():
        for i in inputs:
            users[i].add(unit)
    key = {unit: position[members[0]] for unit, members in units.items()}
    ready = [(key[u], u) for u, inputs in needs.items() if not inputs]
    heapq.heapify(ready)
    waiting = {u: len(inputs) for u, inputs in needs.items()}
    order: list[torch.fx.Node] = []
    while ready:
        _, unit = heapq.heappop(ready)
        order += units[unit]
        for user in users[unit]:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, (key[user], user))
    return order if len(order) == len(nodes) else None


def in_place(kernels: dict[torch.fx.Node, set[torch.fx.Node]], kept: set[torch.fx.Node]) -> dict[torch.fx.Node, torch.fx.Node]:
    """Materialized pointwise results Inductor writes over an input (its ``inplace_buffers``): an
    input of the same bytes that only this result reads (through the ops it computes in registers),
    and nothing after it; the input is a matmul's output or another generated kernel's, not a view,
    an input of the graph or an aten fallback's result; the result is not an output of the graph
    (its storage would leave the graph as the input's). SwiGLU's backward kernel writes three
    results from the gate, the up projection and their gradient, each read by several of them: it
    writes none of them in place; GELU's writes the gradient over the matmul output it alone reads."""

    def nbytes(node: torch.fx.Node) -> int | None:
        value = node.meta.get("val")
        return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else None

    def readers(source: torch.fx.Node) -> set[torch.fx.Node]:  # the materialized nodes that read it
        out, seen, stack = set(), set(), list(source.users)
        while stack:  # each fused op once: two fused readers that join again are not two paths
            user = stack.pop()
            if user in seen:
                continue
            seen.add(user)
            if user in kept or user.op != "call_function":
                out.add(user)
            else:
                stack.extend(user.users)
        return out

    out: dict[torch.fx.Node, torch.fx.Node] = {}
    for node, kernel in kernels.items():
        if not all(r.op == "call_function" for r in readers(node)):
            continue  # an output of the graph
        inputs = {i for n in kernel for i in n.all_input_nodes if i not in kernel and i.op == "call_function"}
        for source in sorted(inputs, key=lambda n: n.name):
            kind = _kind(source)
            written = kind in ("pointwise", "reduction") or source.target in _MATMULS
            if written and source not in out.values() and nbytes(source) == nbytes(node) \
                    and readers(source) == {node}:
                out[node] = source
                break
    return out


_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)


class _Fused(torch.fx.Interpreter):
    """Runs a compiled graph node by node, freeing each value after its last use; a node Inductor
    would fuse away runs untracked (``in_fused_kernel``). A fused node is computed inside the
    kernel that consumes it, so what it reads is read there: its inputs (and what fused inputs
    read, in turn) are held until the fused node's own last use. The fused node's place in the
    graph is not where its inputs are last read: an add fused into a later norm's backward keeps
    the matmul output it adds alive until then (Inductor's generated code does)."""

    def __init__(self, graph: torch.fx.GraphModule) -> None:
        kept = materialized(graph.graph)
        self.over = in_place(kernel_order(graph.graph, kept), kept)  # a result -> the input it is written over
        super().__init__(graph, garbage_collect_values=True)
        self.kept = kept - set(self.over)  # written over an input: no memory of its own
        self.holds: dict[torch.fx.Node, list[Any]] = {}  # fused node -> the values its kernel reads
        self.sources: dict[torch.fx.Node, Any] = {}  # an input written over -> its value, until then

    def boxed(self) -> Any:
        """AOTAutograd's boxed calling convention: the callee takes the list of inputs and clears
        it, so each input (a saved activation, in the backward) is freed after its last use."""

        def call(args: list) -> Any:
            queue = collections.deque(args)
            args.clear()
            self.env, self.holds = {}, {}
            self.sources = dict.fromkeys(self.over.values())
            try:
                for node in self.module.graph.nodes:
                    if node.op == "placeholder":
                        self.env[node] = queue.popleft()
                    elif node.op == "output":
                        return self.fetch_args_kwargs_from_env(node)[0][0]
                    else:
                        self.env[node] = self.run_node(node)
                        if node in self.sources:  # an input a later result is written over
                            self.sources[node] = self.env[node]
                        if node in self.over:  # its storage is the input's: held as long as it lives
                            self.holds[node] = [self.sources.pop(self.over[node])]
                        elif node.op == "call_function" and node not in self.kept:
                            self.holds[node] = [value for i in node.all_input_nodes
                                                for value in self.holds.get(i, [self.env[i]])]
                    for dead in self.user_to_last_uses.get(node, ()):
                        del self.env[dead]
                        self.holds.pop(dead, None)
            finally:
                self.env, self.holds, self.sources = {}, {}, {}
            raise AssertionError("a graph without an output node")

        call._boxed_call = True  # type: ignore[attr-defined]
        return call

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """The partitioner wraps random ops it recomputes in RNG-state higher-order ops; the state
        is a few bytes: run the op itself."""
        from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

        if target is run_and_save_rng_state:
            op, *rest = args
            return torch.zeros((), dtype=torch.uint8), op(*rest, **kwargs)
        if target is run_with_rng_state:
            _state, op, *rest = args
            return op(*rest, **kwargs)
        return super().call_function(target, args, kwargs)

    def run_node(self, node: torch.fx.Node) -> Any:
        if node.op != "call_function" or node in self.kept:
            return super().run_node(node)
        _FUSED.active = True
        try:
            return super().run_node(node)
        finally:
            _FUSED.active = False


@contextlib.contextmanager
def _untracked() -> Iterator[None]:
    """No dispatch mode (the memory tracker, the fake mode: AOTAutograd finds the fake mode from its
    inputs) and no global module hooks (the tracker's module tracker) while compiling."""
    from torch.nn.modules import module as module_globals
    from torch.utils._python_dispatch import _disable_current_modes

    names = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
             "_global_forward_hooks_with_kwargs", "_global_backward_hooks", "_global_backward_pre_hooks")
    saved = {name: dict(getattr(module_globals, name)) for name in names}
    for name in names:
        getattr(module_globals, name).clear()
    try:
        with _disable_current_modes():
            yield
    finally:
        for name in names:
            getattr(module_globals, name).update(saved[name])
