"""OptimizedModule: the model with its regions swapped for kbench's. It shares the original's
parameters, buffers and submodules (the very same tensors and dicts), binds each input signature
to a Program once, runs the usual call from C++ where it can (kbench._fast.Program) and sends
anything outside what was captured and verified to eager with a one-time reason."""
from __future__ import annotations

import logging

import torch

from ..dtypes import torch_dtype
from ..report import Report
from . import fast, graphs, joint, param_cache
from .autograd import RegionBackward, apply_region
from ..capture import guards
from ..capture.signature import CallSpec
from ..capture.modes import autocast_mode, describe_mode
from .plan import KERNEL, MATERIALIZE, Executor, Fallback, Plan, Program, RegionFallback

log = logging.getLogger("kbench")

MAX_VARIANTS = 8    # captures made for other Python state, at most (torch.compile's recompile limit)

# attributes the wrapper keeps for itself; any other plain attribute set on it is the original's
_OWN = frozenset(torch.nn.Module().__dict__) | {"training"}


class SharesOriginal:
    """A wrapper of the user's module (`_kbench_orig`) whose plain attributes are the original's: read
    through the wrapper (model.scale, model.config, its methods), and set on the original when set
    on the wrapper, where the forward reads them (and the Python-state guards see the change). The
    wrapper's own state (nn.Module's, `_kbench_*`) stays its own. Comes before torch.nn.Module."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)   # nn.Module's: parameters, buffers, submodules (the original's)
        except AttributeError:
            orig = self.__dict__.get("_kbench_orig")
            if orig is None or name.startswith(("_kbench", "__")):   # copy and pickle ask for dunders
                raise
            return getattr(orig, name)

    def __setattr__(self, name, value):
        if self._kbench_own(name):
            super().__setattr__(name, value)
        else:
            setattr(self._kbench_orig, name, value)

    def __delattr__(self, name):
        if self._kbench_own(name):
            super().__delattr__(name)
        else:
            delattr(self._kbench_orig, name)

    def _kbench_own(self, name) -> bool:
        """The wrapper's own attribute: its state, nn.Module's (what module.compile() sets included)."""
        return ("_kbench_orig" not in self.__dict__ or name in _OWN or name.startswith("_kbench")
                or name in self.__dict__ or hasattr(type(self), name))


def _serve(other, training: bool, args, kwargs):
    """Call `other`, a module captured for another mode or Python state, in `training`; or in the
    mode it was captured in, where that differs: a capture takes the original model's mode, and
    the two differ only where the original was switched itself (model.eval() rather than
    optimized.eval()), whose flags, its submodules' included, are then what eager runs with. Set
    to the other mode, `other` would capture again, from the same original, for ever."""
    captured = getattr(other, "_kbench_captured_training", None)
    other.training = training if captured is None else captured
    return other(*args, **kwargs)


class OptimizedModule(SharesOriginal, RegionBackward, torch.nn.Module):
    """The model with its regions swapped for kbench's. Shares the original's parameters and
    buffers (the very same tensors, the same state_dict keys); the original is left as it was."""

    def __init__(self, module: torch.nn.Module, captured, executor: Executor, device: torch.device,
                 grad_in_forward: bool = True, call_spec: CallSpec | None = None, rebuild=None,
                 cuda_graphs="auto", restore=None):
        """call_spec: how a call's arguments map to the captured graph's inputs (None: tensors
        passed positionally). rebuild(args, kwargs) -> an OptimizedModule captured at that call:
        for the module's other train/eval mode, or for Python state the forward reads that changed
        (None: such calls run in eager). cuda_graphs: "auto", True, False or "inference" (runtime/graphs.py):
        calls replayed from CUDA graphs where that is safe. restore: (function, arguments) that
        make this module again from the original (pickle, deepcopy: __reduce__); None: it
        cannot be pickled."""
        super().__init__()
        fast.install_module_call(OptimizedModule)   # once: the plain call goes straight to C++
        # share, not copy: the same dicts, so .parameters(), state_dict() and optimizers see the
        # original's tensors, and updates through either module are the same update
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._modules = module._modules
        self.training = module.training
        plan = Plan(captured.graph, captured.externs, captured.example_symvals, captured.static_reason,
                    captured.guards, save_stats=True, origin=captured.origin, calls=captured.calls,
                    kept=captured.kept)
        executor.prepare(plan, device)
        self.__dict__.update(_kbench_orig=module, _kbench_captured=captured, _kbench_plan=plan,
                             _kbench_executor=executor, _kbench_reasons=set(), _kbench_device=device,
                             _kbench_program=Program(plan, executor, self._note), _kbench_backward={},
                             _kbench_unused_grads={}, _kbench_grad_checks={},
                             _kbench_captured_training=module.training,
                             _kbench_captured_autocast=autocast_mode())
        # parameters and buffers as captured: a later .double() or resize sends calls to eager
        nuser = len(captured.input_names)
        self.__dict__["_kbench_param_meta"] = [
            (plan.nodes[v]["name"], torch_dtype(plan.nodes[v]["dtype"]),
             torch.Size(plan.graph.sizes(v, plan.example_symvals)))
            for v in plan.graph.inputs[nuser:]]
        self.__dict__["_kbench_param_chains"] = self._param_chains()
        # values computed from parameters alone, once per parameter version (param_cache.py)
        self.__dict__["_kbench_pcache"] = param_cache.ParamCache(nuser, self._kbench_param_meta, device)
        # constants the forward makes (lifted by export) where the kernels read them: a 0-dim CPU
        # tensor mixes with CUDA tensors in eager's ops, so it moves to the module's device
        self.__dict__["_kbench_constants"] = {
            k: v.to(device) if isinstance(v, torch.Tensor) and v.dim() == 0 and v.device != device else v
            for k, v in captured.constants.items()}
        self.__dict__["_kbench_sigs"] = {}
        # a loss: its gradients computed in the forward (joint.py); per need pattern, the
        # joint program (None: not used) and, for the report, whether and why
        why = joint.scalar_output(plan, captured) if grad_in_forward else "grad_in_forward=False"
        self.__dict__.update(_kbench_loss_why=why, _kbench_loss={}, _kbench_joint={})
        # the Python state the forward read (capture/guards.py), checked at every call: stale when
        # it already differs from what the capture read (the forward changes it, or a stored
        # capture met another state)
        try:
            state, stale = guards.bind(module, captured.python_state, native=fast.guards_type()), ""
        except guards.Stale as e:
            state, stale = None, str(e)
        self.__dict__.update(_kbench_state=state if state else None, _kbench_stale=stale, _kbench_variants=[],
                             _kbench_uncaptured=[], _kbench_restore=restore)
        spec = call_spec if call_spec is not None else CallSpec(tuple(torch.empty(0) for _ in range(nuser)), {})
        program = self._fast_program()
        # kbench._fast.module_call reads _kbench_fast_program and passes it the call's own
        # arguments: only a plain signature (tensors, positionally) may go there unflattened
        self.__dict__.update(_kbench_spec=spec, _kbench_fast_flat=None if spec.plain else program,
                             _kbench_fast_program=program if spec.plain else None,
                             _kbench_rebuild=rebuild, _kbench_modes={}, _kbench_original="",
                             _kbench_mutated=self._mutated_slots(), _kbench_written=self._written_inputs(),
                             _kbench_write_deps=self._write_deps())
        # last: the graph runner stands where the fast program stands, and hands it what it declines
        graphs.install(self, cuda_graphs)
        if stale:
            self.run_original(f"the forward changes Python state ({stale}): a capture would be stale at "
                              "the next call")

    def __reduce__(self):
        """pickle, copy.deepcopy, torch.save: the original module (with its parameters) and how it was
        optimized; loading optimizes it again (from the capture cache, where it holds)."""
        if self._kbench_restore is None:
            raise TypeError("this OptimizedModule was not made by kbench.optimize(), so it cannot be made again "
                            "when loaded: pickle the original module instead")
        fn, args = self._kbench_restore
        return fn, (self._kbench_orig, *args)

    @property
    def kbench_report(self):
        return Report.from_module(self)

    def train(self, mode: bool = True):
        self._kbench_orig.train(mode)
        return super().train(mode)

    def _note(self, reason: str):
        if reason not in self._kbench_reasons:
            self._kbench_reasons.add(reason)
            log.warning("kbench: running in eager PyTorch: %s", reason)

    def _fallback(self, reason: str, args, kwargs):
        self._note(reason)
        return self._kbench_orig(*args, **kwargs)

    def run_original(self, reason: str) -> None:
        """From now on every call runs the original module (the model-level gate found kbench's
        no faster); the report says why."""
        runner = self.__dict__.get("_kbench_graphs")
        if runner is not None and not isinstance(runner, str):
            runner.release("the model gate runs the original module")
        self.__dict__.update(_kbench_original=reason, _kbench_fast_program=None, _kbench_fast_flat=None)

    def forward(self, *args, **kwargs):
        if self._kbench_original:
            return self._kbench_orig(*args, **kwargs)
        # the common case in C++ (kbench._fast.Program): a bound signature, every region a
        # generated kernel; NotImplemented for anything else, decided before any launch. A
        # plain call (no hooks) does this in C++ too: kbench._fast.module_call, fast.install_module_call
        inputs = self._inputs(args, kwargs)
        if isinstance(inputs, str):
            return self._fallback(inputs, args, kwargs)
        program = self._kbench_fast_program if self._kbench_spec.plain else self._kbench_fast_flat
        if program is not None:
            try:
                out = program.call(self, inputs)
            except Fallback as e:
                return self._fallback(str(e), args, kwargs)
            if out is not NotImplemented:
                return out
        return self._forward_inputs(inputs, args, kwargs)

    def _inputs(self, args, kwargs):
        """The graph's user inputs for a call (a tuple of tensors), or why it cannot have them."""
        spec = self._kbench_spec
        if spec.plain and not kwargs:
            if len(args) == len(spec.tensor_at) and all(isinstance(a, torch.Tensor) for a in args):
                return args
        got = spec.tensors(args, kwargs)
        return got if isinstance(got, str) else tuple(got)

    def _forward_python(self, args, kwargs):
        """The forward where kbench._fast.Program declines (kbench._fast.module_call calls this
        with the call's own arguments): a new signature to bind, a step or an output it leaves to
        Python, a fallback."""
        inputs = self._inputs(args, kwargs)
        if isinstance(inputs, str):
            return self._fallback(inputs, args, kwargs)
        return self._forward_inputs(inputs, args, kwargs)

    def _in_captured_mode(self) -> bool:
        return self.training == self._kbench_captured_training and autocast_mode() == self._kbench_captured_autocast

    def _forward_inputs(self, inputs, args, kwargs):
        if not self._in_captured_mode():
            return self._other_mode(args, kwargs)
        state = self._kbench_state
        if state is not None:
            failing = state.failing()
            if failing >= 0:
                return self._state_changed(state, failing, args, kwargs)
        # the hot path: sizes bound once per input signature (shapes, dtypes, devices)
        sig = tuple((x.shape, x.dtype, x.device) for x in inputs)
        bound = self._kbench_sigs.get(sig)
        if bound is None:
            bound = self._bind(inputs, sig)
            if isinstance(bound, str):
                return self._fallback(bound, args, kwargs)
        try:
            return self._run(bound, inputs)
        except Fallback as e:
            return self._fallback(str(e), args, kwargs)

    def _other_mode(self, args, kwargs):
        """A call in a train/eval mode or under an autocast the module was not captured in:
        served by a module of its own, captured and prepared at the first such call (a model that
        switches between training and evaluation, or runs with and without autocast, keeps
        kbench's kernels in each). _kbench_modes is keyed by (training, autocast_mode())."""
        mode = (self.training, autocast_mode())
        other = self._kbench_modes.get(mode)
        if other is None:
            why = "the module's train/eval mode or autocast differs from the captured one"
            if self._kbench_rebuild is not None:
                try:
                    other = self._kbench_rebuild(args, kwargs)
                    why = ""
                except Exception as e:  # noqa: BLE001 - that mode runs in eager, with the reason
                    why = f"{describe_mode(mode)} could not be captured ({type(e).__name__}: " \
                          f"{str(e).splitlines()[0] if str(e) else ''})"
            other = self._kbench_modes[mode] = other if other is not None else why
        if isinstance(other, str):
            return self._fallback(other, args, kwargs)
        return _serve(other, mode[0], args, kwargs)

    def _state_holds(self) -> bool:
        state = self._kbench_state
        return not self._kbench_stale and (state is None or state.failing() < 0)

    def _state_changed(self, state, failing, args, kwargs):
        """A call after the Python state the forward read changed (an attribute, a global; entry
        `failing` of `state`): served by a capture made for the state as it is now (made at the
        first such call, with a log line), or in eager past MAX_VARIANTS of them."""
        variants = self._kbench_variants
        for _, other in variants:
            if other._state_holds():
                return _serve(other, self.training, args, kwargs)
        mine = self._kbench_state
        for failed, why in self._kbench_uncaptured:   # a state that could not be captured: eager
            if mine.holds_at(failed):
                return self._fallback(why, args, kwargs)
        last = variants[-1][1]._kbench_state if variants else None
        if last is not None and last.failing() >= 0:   # what changed since the last capture
            state, failing = last, last.failing()
        # the eager reason names what changed, not its values: one reason (and one log line) for a
        # value that keeps changing
        if self._kbench_rebuild is None:
            return self._fallback(f"{state.labels[failing]} changed since the capture", args, kwargs)
        if len(variants) >= MAX_VARIANTS:
            return self._fallback(f"{state.labels[failing]} changed since the capture, and {MAX_VARIANTS} captures "
                                  "were made for other Python state already", args, kwargs)
        why = state.why(failing)
        log.warning("kbench: %s since the capture; capturing again", why)
        try:
            other = self._kbench_rebuild(args, kwargs)
        except Exception as e:  # noqa: BLE001 - that state runs in eager, with the reason, and is not tried again
            why = (f"{state.labels[failing]} changed since the capture, and the state as it is could not be "
                   f"captured ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            self._kbench_uncaptured.append((mine.now(), why))
            return self._fallback(why, args, kwargs)
        variants.append((why, other))
        return _serve(other, self.training, args, kwargs)

    def _bind(self, args, sig):
        """The program bound to a new input signature's sizes, or the reason the call must go to
        eager."""
        captured = self._kbench_captured
        for i, x in enumerate(args):
            if x.numel() == 0:   # eager's empty results (a sum of 0, a mean of nan, max's error)
                return f"input {i} is empty (sizes {list(x.shape)}): empty tensors run in eager PyTorch"
        try:
            symvals = tuple(captured.bind(args))
        except ValueError as e:
            return str(e)
        bound = self._kbench_program.bind(symvals, hoist=True)
        for step in bound.steps:
            step.owner = self
            if step.kind == KERNEL:
                step.fast = self._fast_region(step)
        bound.cache = self._kbench_pcache.plan(bound)
        if sig is not None:
            program = self._kbench_fast_program
            if len(self._kbench_sigs) > 256:   # many shapes: keep the table bounded
                self._kbench_sigs.clear()
                if program is not None:
                    program.clear()
            self._kbench_sigs[sig] = bound
            if program is not None:
                entry = self._fast_entry(bound)
                if entry is not None:
                    program.add(tuple(args), *entry)
        return bound

    def _fast_program(self):
        """The kbench._fast.Program that runs the common call from C++, where the executor's
        launches are kbench._fast's; None: every call takes the Python path."""
        if self._kbench_executor.name != "cuda":
            return None
        ext = fast.module()   # None under KBENCH_FAST=0 (or where it was not built)
        if ext is None or not hasattr(ext, "Program"):
            return None
        state = self._kbench_state
        # the C++ call checks the Python state as the Python path does, with kbench._fast.Guards
        # (a dict lookup and an identity or == per value read: a few microseconds for a GPT-2);
        # where that is missing, the Python path keeps every call
        if state is not None and state.native is None:
            return None
        checks = {"guards": state.native} if state is not None else {}
        return ext.Program(orig=self._kbench_orig, captured=self._kbench_captured,
                            ninputs=len(self._kbench_captured.input_names), chains=self._kbench_param_chains,
                            meta=self._kbench_param_meta, training=self._kbench_captured_training,
                            grad_ok=bool(self._kbench_loss_why), apply_region=apply_region,
                            autocast=self._kbench_captured_autocast, **checks)

    def _fast_entry(self, bound):
        """What kbench._fast.Program.add takes for this bound signature: (steps, outputs, build,
        cache), or None where _run must run every call: a region that is not a kbench._fast launch
        and Region (eager, EXTERN, a Python launcher) and whose values the parameter cache does not
        hold, a value torch computes in between, in-place updates to copy back."""
        captured = self._kbench_captured
        if captured.mutations:
            return None
        steps = []
        for step in bound.steps:
            launch = fast.launch_of(step.launch_nograd or step.launch) if step.kind == KERNEL else None
            if launch is not None and step.fast is not None:
                steps.append((step, launch, step.fast, list(step.ins), len(step.out_meta), step.cache))
            elif step.cache >= 0:   # only the cache runs it in C++ (a call with gradients: Python)
                steps.append((step, None, None, list(step.ins), len(step.made), step.cache))
            else:
                return None
        # build_outputs as C++ reproduces it where that is exact: the one output itself, or a
        # plain tuple of outputs; anything else (a dict, None or a size among them) it calls
        probe = [object() for _ in bound.outputs]
        try:
            shaped = captured.build_outputs(probe, bound.symvals)
        except Exception:  # noqa: BLE001 - whatever it does with real tensors, the Python path does it
            return None
        where = {id(p): i for i, p in enumerate(probe)}
        if bound.cache is not None and bound.cache.clone:
            return None   # outputs that may be views of cached values: _run copies them
        if id(shaped) in where:
            return steps, [bound.outputs[where[id(shaped)]]], "one", bound.cache
        if type(shaped) is tuple and shaped and all(id(x) in where for x in shaped):
            return steps, [bound.outputs[where[id(x)]] for x in shaped], "tuple", bound.cache
        symvals, build = bound.symvals, captured.build_outputs
        return steps, list(bound.outputs), lambda outs: build(outs, symvals), bound.cache

    def _mutated_slots(self):
        """The call's slots (user inputs, then parameters and buffers) that the forward updates in
        place (BatchNorm's running statistics, an input's x.mul_()): under autograd each region
        reads a copy taken before the update, since a node saved with the tensor itself would
        find it changed (torch's version check) when its backward runs."""
        captured = self._kbench_captured
        nuser = len(captured.input_names)
        slots = set()
        for _, kind, name in captured.mutations:
            if kind == "user" and name in captured.input_names:
                slots.add(captured.input_names.index(name))
            elif name in captured.param_names:
                slots.add(nuser + captured.param_names.index(name))
        return sorted(slots)

    def _written_inputs(self):
        """(user input, whether eager's first in-place op on it writes a view of it) for each user
        input the forward writes in place with autograd on (captured.input_writes)."""
        captured = self._kbench_captured
        return [(captured.input_names.index(name), view) for name, (count, view) in captured.input_writes.items()
                if count and name in captured.input_names]

    def _write_deps(self):
        """{graph output of a user input's update: the call's slots it has a differentiable path
        from}. Eager's update requires grad where one of those does (kbench's region nodes mark
        every output of a region that any input of which requires grad): an input that needs no
        gradient, updated from values that need none, stays without one."""
        captured, plan = self._kbench_captured, self._kbench_plan
        outs = [out for out, kind, _ in captured.mutations if kind == "user"]
        if not outs:
            return {}
        slot_of = {v: k for k, v in enumerate(plan.graph.inputs)}
        deps = []
        for v, node in enumerate(plan.nodes):   # topological order
            if v in slot_of:
                d = frozenset((slot_of[v],))
            elif not torch_dtype(node["dtype"]).is_floating_point or node["nograd"] or (
                    node["op"] == "extern" and "detach" in captured.externs[node["index"]].name):
                d = frozenset()   # no gradient through an integer or bool value, a stop-gradient
            else:
                d = frozenset().union(*(deps[i] for i in node["inputs"]))
            deps.append(d)
        return {out: deps[plan.graph.outputs[out]] for out in outs}

    def _param_chains(self):
        """(module path, table, name) per parameter/buffer input: read through the live modules'
        own dicts at each call, so a replaced tensor or submodule is the one used."""
        chains = []
        for v in self._kbench_plan.graph.inputs[len(self._kbench_captured.input_names):]:
            name = self._kbench_plan.nodes[v]["name"]
            if name in self._kbench_captured.constants:
                chains.append((None, None, name))
                continue
            *path, leaf = name.split(".")
            owner = self._kbench_orig.get_submodule(".".join(path)) if path else self._kbench_orig
            table = "_parameters" if leaf in owner._parameters else "_buffers"
            chains.append((tuple(path), table, leaf))
        return chains

    def _params(self):
        out = []
        constants = self._kbench_constants
        for path, table, leaf in self._kbench_param_chains:
            if path is None:
                out.append(constants[leaf])
                continue
            m = self._kbench_orig
            try:
                for part in path:
                    m = m._modules[part]
                t = getattr(m, table)[leaf]
            except (KeyError, AttributeError):
                raise Fallback(f"{'.'.join(path + (leaf,))} is gone from the module") from None
            if t is None:
                raise Fallback(f"{'.'.join(path + (leaf,))} is None")
            out.append(t)
        return out

    def _checked_params(self, device):
        """The parameters, buffers and constants the graph reads, as captured (else Fallback).
        Checked every call: module.double() or .to() change a Parameter's dtype in place
        (param.data = ...), so the same tensor object can come back as something else."""
        params = self._params()
        for t, (name, dtype, shape) in zip(params, self._kbench_param_meta):
            if t.dtype != dtype or t.shape != shape or t.device != device:
                raise Fallback(f"{name} is now {t.dtype}{list(t.shape)} on {t.device}; it was captured as "
                               f"{dtype}{list(shape)}, and the inputs are on {device}")
        return params

    def kbench_refresh(self) -> None:
        """Compute every value cached from the parameters alone again at its next use: for writes
        their version counters do not see (p.data.copy_(...), memory shared outside torch)."""
        self._kbench_pcache.forget()
        for other in self._kbench_modes.values():
            if isinstance(other, OptimizedModule):
                other.kbench_refresh()
        for _, other in self._kbench_variants:
            other.kbench_refresh()

    def _run(self, bound, args, params=None, built=True, cached=True):
        """params: the parameters, buffers and constants to read in place of the module's own (a
        training capture's aliases, runtime/train_graphs.py); None: the module's, checked.
        built=False: the graph's outputs as a list, not the model's output structure (a CUDA-graph
        capture builds that after each replay: a container's unflatten may run code a capture
        cannot take, as Hugging Face's cache does with its update). cached: a call that records
        no autograd history reads the values computed from parameters alone from the cache
        (param_cache.py), computing those whose parameters changed; "held": reads them as they
        are (a CUDA-graph capture, the cache refreshed just before); False: computes them."""
        captured = self._kbench_captured
        device = args[0].device if args else self._kbench_device
        params = self._checked_params(device) if params is None else params
        for x in args:
            if x.device != device:
                raise Fallback(f"tensors on {device} and {x.device}")
        slots = [*args, *params]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in slots)
        carries = set()   # the input updates that carry a gradient from this call's inputs
        if grad and self._kbench_written:
            _check_inplace(args, self._kbench_written)
            carries = {out for out, deps in self._kbench_write_deps.items() if any(slots[i].requires_grad for i in deps)}
        if grad:
            for i in self._kbench_mutated:
                slots[i] = slots[i].clone()
        if grad and not self._kbench_loss_why:
            need = tuple(t.requires_grad and t.is_floating_point() for t in slots)
            program = self._kbench_joint.get(need, False)
            if program is False:
                program = self._kbench_joint[need] = joint.build(self, need)
            if program is not None:
                loss = joint.LossFunction.apply(program, bound.symvals, *slots)
                return captured.build_outputs([loss], bound.symvals)
        held = None
        if cached and not grad and bound.cache is not None:
            held = bound.cache.take(params, check=cached != "held")
        for step in bound.steps:
            if held is not None and step.cache >= 0:
                slots.extend(held[step.cache])
                for i in step.release:
                    slots[i] = None
                continue
            ins = [slots[i] for i in step.ins]
            if step.kind == KERNEL:
                if grad and any(x.requires_grad for x in ins):
                    fast = step.fast
                    if fast is None:
                        slots.extend(apply_region(step, *ins))
                    else:
                        try:
                            slots.extend(fast.apply(*ins))
                        except RegionFallback:   # the Python node runs it in eager, and notes why
                            slots.extend(apply_region(step, *ins))
                    if step.nsaved:
                        slots.extend(step.no_stats)
                else:
                    slots.extend(step.run(ins))
            elif step.kind == MATERIALIZE or step.launch is not None:   # an EAGER region with work hoisted
                slots.extend(step.launch(ins))
            else:
                slots.extend(self._kbench_plan.eager_region(step.r, bound.symvals, ins))
            del ins
            for i in step.release:
                slots[i] = None
        outs = [slots[i] for i in bound.outputs]
        if held is not None:
            for j in bound.cache.clone:   # a view of a cached value: the cache writes it again later
                outs[j] = outs[j].clone()
        if captured.mutations:
            captured.apply_mutations(self._kbench_orig, args, outs, carries)
        return captured.build_outputs(outs, bound.symvals) if built else outs


def _check_inplace(args, written):
    """Eager's check before an in-place op under grad mode (torch's check_inplace): the forward
    writes these inputs in place, so a leaf that requires grad, or a view of one, raises eager's
    RuntimeError before anything runs (the write-back after the forward would find it too, but
    only after buffers were updated)."""
    for i, through_view in written:
        x = args[i]
        if not x.requires_grad:
            continue
        base = x._base
        if (x.is_leaf and through_view) or (base is not None and base.is_leaf and base.requires_grad):
            raise RuntimeError("a view of a leaf Variable that requires grad is being used in an in-place operation.")
        if x.is_leaf:
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
