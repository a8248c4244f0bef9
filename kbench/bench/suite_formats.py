"""The public suites' task formats (KernelBench files, robust-kbench task folders): detection from
a path and each task's configs, read as data (ast, JSON), plus LocalSuiteTask, the task's real
module. LocalSuiteTask imports the task file and so runs only in a worker process (worker.py);
the harness's process sees a suite task through suites.SuiteTask, which asks a worker."""
from __future__ import annotations

import ast
import json
import os
import re
from typing import Dict, List, Optional

import torch

from .compare import flatten
from .tasks import Task, parse_dtype

KERNELBENCH, ROBUST = "kernelbench", "robust-kbench"
# Module-level constants a KernelBench file's batch dimension goes by, in the order tried. The
# first that is an int > 1 and that get_init_inputs does not read (so the model is the same) gets
# a second input config at v // 2 + 1: a size that is neither the original nor a power of two.
BATCH_NAMES = ("batch_size", "batch", "bs", "B", "N", "M")
INIT_SEEDS = {"seed0": 0, "seed1": 1}   # KernelBench/robust-kbench models draw their own init


def alt_batch(value: int) -> int:
    return value // 2 + 1


# ------------------------------------------------------------------------- detection

def _is_kernelbench_file(path: str) -> bool:
    if not path.endswith(".py") or os.path.basename(path).startswith("_"):
        return False
    with open(path, errors="replace") as f:
        text = f.read()
    return "get_init_inputs" in text or "get_inputs" in text


def detect(path: str) -> List[dict]:
    """The suite tasks under `path` as specs {"format", "path", "mode", "name"}: a KernelBench
    level folder or file, or the folder of its levels (level1/, level2/, ...: names carry the
    level, "kb:level2/19_ReLU"), a robust-kbench tasks/ folder, task folder or func_*.py file.
    Raises ValueError where the path is neither."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        base = os.path.basename(path)
        if base in ("func_forward.py", "func_backward.py"):
            return _robust_dir(os.path.dirname(path))
        if _is_kernelbench_file(path):
            return [_kb_spec(path)]
        raise ValueError(f"{path}: not a KernelBench task file (no get_inputs)")
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such file or folder")
    if os.path.exists(os.path.join(path, "func_forward.py")):
        return _robust_dir(path)
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        if "func_forward.py" in files:
            found += _robust_dir(root)
            dirs[:] = []
    if found:
        return found
    kb = _kb_level(path)
    if kb:
        return kb
    # KernelBench's own root: level1/ ... level4/, each task named with its level (numbers repeat)
    levels = sorted((d for d in os.listdir(path) if re.fullmatch(r"level\d+", d)
                     and os.path.isdir(os.path.join(path, d))), key=lambda d: int(d[5:]))
    found = [dict(t, name=f"kb:{d}/{t['name'][3:]}") for d in levels for t in _kb_level(os.path.join(path, d))]
    if found:
        return found
    raise ValueError(f"{path}: neither a KernelBench level folder (or the folder of its levels) nor "
                     f"robust-kbench tasks")


def _kb_level(path: str) -> List[dict]:
    """The KernelBench task files directly in a folder, in their numbers' order."""
    kb = [os.path.join(path, f) for f in os.listdir(path) if _is_kernelbench_file(os.path.join(path, f))]
    return [_kb_spec(f) for f in sorted(kb, key=_numeric_key)]


def _numeric_key(path: str):
    m = re.match(r"(\d+)", os.path.basename(path))
    return (int(m.group(1)) if m else 1 << 30, os.path.basename(path))


def _kb_spec(path: str) -> dict:
    return {"format": KERNELBENCH, "path": path, "mode": "forward",
            "name": "kb:" + os.path.splitext(os.path.basename(path))[0]}


def _robust_dir(d: str) -> List[dict]:
    name = "rk:" + os.path.basename(d.rstrip(os.sep))
    out = [{"format": ROBUST, "path": d, "mode": "forward", "name": name}]
    if os.path.exists(os.path.join(d, "func_backward.py")):
        out.append({"format": ROBUST, "path": d, "mode": "backward", "name": name + ":bwd"})
    return out


# ------------------------------------------------------------------------- configs, as data

def _kb_constants(tree: ast.Module) -> Dict[str, object]:
    out = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                pass
    return out


def _names_read_by(tree: ast.Module, func: str) -> set:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == func:
            return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    return set()


def kernelbench_configs(path: str) -> List[dict]:
    """The file's own sizes ("base") and, where a batch-like constant allows, a second shape."""
    with open(path, errors="replace") as f:
        tree = ast.parse(f.read(), filename=path)
    consts = _kb_constants(tree)
    init_reads = _names_read_by(tree, "get_init_inputs")
    cfgs = [{"name": "base", "set": {}}]
    for n in BATCH_NAMES:
        v = consts.get(n)
        if type(v) is int and v > 1 and n not in init_reads:
            cfgs.append({"name": f"{n}_{alt_batch(v)}", "set": {n: alt_batch(v)}})
            break
    return cfgs


def _config_str(init_c: dict, input_c: dict) -> str:
    s = "_".join([f"{k}_{v}" for k, v in init_c.items()] + [f"{k}_{v}" for k, v in input_c.items()])
    return re.sub(r"[ .\-=]", "_", s)


def robust_configs(d: str, mode: str) -> List[dict]:
    """robust-kbench's config file: for each of its single and multi settings, every
    (init, input, shared) combination, the shared config overriding both the init config (the
    Model's keyword arguments) and the input config (get_inputs' keyword arguments), as its
    ConfigTask does. The single setting first; duplicates dropped."""
    with open(os.path.join(d, f"config_{mode}.json")) as f:
        conf = json.load(f)
    out, seen = [], set()
    for kind in ("single", "multi"):
        if not any(f"{kind}_{x}_configs" in conf for x in ("init", "input", "shared")):
            continue   # a file with no multi setting has no default config either
        for init in conf.get(f"{kind}_init_configs") or [{}]:
            for inp in conf.get(f"{kind}_input_configs") or [{}]:
                for shared in conf.get(f"{kind}_shared_configs") or [{}]:
                    init_c, input_c = {**init, **shared}, {**inp, **shared}
                    key = json.dumps([init_c, input_c], sort_keys=True)
                    if key in seen:
                        continue
                    seen.add(key)
                    out.append({"name": _config_str(init_c, input_c) or "default",
                                "init": init_c, "inputs": input_c})
    names = [c["name"] for c in out]
    for i, c in enumerate(out):   # config strings can collide (1.5 and 1_5): number them
        if names.count(c["name"]) > 1:
            c["name"] += f"_{i}"
    return out


def describe(spec: dict) -> dict:
    """Configs and facts of a spec, read without running the task's code."""
    if spec["format"] == KERNELBENCH:
        cfgs = kernelbench_configs(spec["path"])
        with open(spec["path"], errors="replace") as f:
            doc = _class_doc(f.read(), "Model")
        return {"configs": cfgs, "backward": False, "description": doc}
    cfgs = robust_configs(spec["path"], spec["mode"])
    with open(os.path.join(spec["path"], f"func_{spec['mode']}.py"), errors="replace") as f:
        doc = _class_doc(f.read(), "Model")
    return {"configs": cfgs, "backward": spec["mode"] == "backward", "description": doc}


def _class_doc(text: str, cls: str) -> str:
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        return f"(does not parse: {e.msg}, line {e.lineno})"
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return " ".join((ast.get_docstring(node) or "").split("\n\n")[0].split())
    return ""


def model_args(spec: dict, cfg: dict) -> dict:
    """What decides the model a config builds (its group key): robust-kbench's init config;
    KernelBench's changed constants are never read by get_init_inputs (kernelbench_configs)."""
    if spec["format"] == ROBUST:
        return {"init": json.dumps(cfg["init"], sort_keys=True)}
    return {}


# ------------------------------------------------------------------------- the real module

def _load_module(path: str, name: str):
    import importlib.util
    mod_name = "kbench_suite_" + re.sub(r"\W", "_", name)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class LocalSuiteTask(Task):
    """A suite task with its module imported: run only in a worker process."""

    def __init__(self, spec: dict):
        self.spec = spec
        info = describe(spec)
        fname = (spec["path"] if spec["format"] == KERNELBENCH
                 else os.path.join(spec["path"], f"func_{spec['mode']}.py"))
        self.module = _load_module(fname, spec["name"])
        self.name = spec["name"]
        self.Model = self.module.Model
        self.input_configs = info["configs"]
        self.init_configs = {k: None for k in INIT_SEEDS}
        self.backward, self.dtypes = info["backward"], ("float32",)
        self.model_args_fn = lambda cfg: model_args(spec, cfg)
        self.bytes_fn = self.flops_fn = None
        self.description = info["description"]

    def _with_constants(self, cfg: dict, fn):
        """fn() with the config's module constants set (KernelBench's second shape)."""
        old = {k: getattr(self.module, k) for k in cfg.get("set", {})}
        try:
            for k, v in cfg.get("set", {}).items():
                setattr(self.module, k, v)
            return fn()
        finally:
            for k, v in old.items():
                setattr(self.module, k, v)

    def build(self, cfg: dict, dtype, device, init: Optional[str] = None,
              seed: int = 0) -> torch.nn.Module:
        init = init or next(iter(INIT_SEEDS))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1000 * seed + INIT_SEEDS[init])
            if self.spec["format"] == KERNELBENCH:
                args, kwargs = list(self._with_constants(cfg, self.module.get_init_inputs)), {}
            else:
                args, kwargs = [], dict(cfg["init"])
            model = self.Model(*args, **kwargs)
        model = model.to(device=device, dtype=parse_dtype(dtype)).eval()
        model._kbench_init_args = (args, kwargs)   # for a KernelBench ModelNew candidate
        # the contract kernel functions are held to on this model (impls.RobustKernelCall)
        model._kbench_suite = {"format": self.spec["format"], "mode": self.spec["mode"]}
        return model

    def inputs(self, cfg: dict, dtype, device, seed: int = 0) -> list:
        """The task's inputs, drawn where they will be used: get_inputs runs with `device` as
        torch's default device, so a task's torch.randn(4096, 393216) is made on the GPU (GBs
        that the host would draw slowly and then copy), seeded there; a tensor it places
        explicitly is moved after."""
        device = torch.device(device)
        rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices), device:
            torch.manual_seed(seed)
            if self.spec["format"] == KERNELBENCH:
                xs = self._with_constants(cfg, self.module.get_inputs)
            else:
                xs = self.module.get_inputs(**cfg["inputs"])
        dt = parse_dtype(dtype)
        return [x.detach().to(device=device, dtype=dt if x.is_floating_point() else x.dtype)
                if isinstance(x, torch.Tensor) else x for x in xs]


_LOCAL: Dict[str, LocalSuiteTask] = {}


def local_task(spec: dict) -> LocalSuiteTask:
    key = json.dumps(spec, sort_keys=True)
    if key not in _LOCAL:
        _LOCAL[key] = LocalSuiteTask(spec)
    return _LOCAL[key]


# ------------------------------------------------------------------------- worker requests

_MODELS: dict = {}


def _model(task: LocalSuiteTask, req: dict, dev) -> torch.nn.Module:
    """The task's model for a request, built once per (config group, init, seed). The models of
    other tasks are let go first: a worker serves a whole suite level, one task after another, and
    kept, their parameters would fill the GPU (a later task's out-of-memory)."""
    key = (task.name, task.group_key(req["cfg"]), req["init"], req["seed"])
    stale = [k for k in _MODELS if k[0] != task.name]
    for k in stale:
        del _MODELS[k]
    if stale and torch.device(dev).type == "cuda":
        torch.cuda.empty_cache()
    if key not in _MODELS:
        _MODELS[key] = task.build(req["cfg"], "float32", dev, init=req["init"], seed=req["seed"])
    return _MODELS[key]


def handle(req: dict, tensors_in, put, dev) -> dict:
    """A suite request in the task's worker (worker.serve): build a model and report its state,
    draw inputs, or run the model's forward (and its gradients) on the values sent."""
    task = local_task(req["suite"])
    op = req["op"]
    if op == "suite_inputs":
        xs = task.inputs(req["cfg"], req["dtype"], dev, seed=req["seed"])
        return {"inputs": [put(x) if isinstance(x, torch.Tensor) else {"py": x} for x in xs]}
    if op == "suite_build":
        m = task.build(req["cfg"], req["dtype"], dev, init=req["init"], seed=req["seed"])
        params = {id(p) for p in m.parameters()}
        sd = m.state_dict(keep_vars=True)
        return {"names": [[n, "param" if id(t) in params else "buffer"] for n, t in sd.items()],
                "state": [put(t.detach()) for t in sd.values()]}
    if op == "suite_forward":
        m = _model(task, req, dev)
        state = tensors_in(req["state"])
        fl = next((t.dtype for t in state if t is not None and t.is_floating_point()), None)
        if fl is not None:
            m.to(fl)
        sd = list(m.state_dict(keep_vars=True).values())
        with torch.no_grad():
            for dst, src in zip(sd, state):
                dst.copy_(src)
        xs = [x if not isinstance(x, dict) else x["py"] for x in req["py_inputs"]]
        ts = iter(tensors_in(req["inputs"]))
        xs = [next(ts) if x is None else x for x in xs]
        if req.get("gouts") is None:
            with torch.no_grad():
                out = m(*xs)
            outs = flatten(out)
            return {"outs": [put(o) for o in outs], "tuple": isinstance(out, (tuple, list))}
        leaves = [x.requires_grad_() for x in xs
                  if isinstance(x, torch.Tensor) and x.is_floating_point()]
        params = list(m.parameters())
        with torch.enable_grad():
            outs = flatten(m(*xs))
        gouts = tensors_in(req["gouts"])
        pairs = [(o, g) for o, g in zip(outs, gouts) if g is not None and o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], leaves + params,
                                    [g for _, g in pairs], allow_unused=True) if pairs else \
            [None] * (len(leaves) + len(params))
        gin, gp = list(grads[:len(leaves)]), dict(zip(map(id, params), grads[len(leaves):]))
        by_arg = []
        for x in xs:
            is_leaf = isinstance(x, torch.Tensor) and x.is_floating_point()
            by_arg.append(put(gin.pop(0)) if is_leaf else None)
        return {"grads": by_arg + [put(gp.get(id(t))) for t in sd]}
    raise ValueError(f"unknown suite request {op!r}")
