"""What CUDA libraries allocate through PyTorch's caching allocator on their own (run on a GPU).

``optbench estimate`` traces the tensors a step creates; cuBLAS/cuBLASLt workspaces are not tensors
of the step, yet they sit in ``torch.cuda.memory_allocated`` (and so in the measured peak). This
prints, per situation, the allocated bytes beyond the result tensors, next to the workspace sizes
torch reports, so the estimate can count what really is there:

    python bench/cuda_workspace.py
"""

from __future__ import annotations

import threading

import torch


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def main() -> None:
    print("torch", torch.__version__, torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
    for name in ("_cuda_getCublasWorkspaceSize", "_cuda_getCublasLtWorkspaceSize"):
        getter = getattr(torch._C, name, None)
        print(f"{name}: {getter() if getter else 'absent in this torch'}")
    n = 512
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    seen = []

    def delta(label: str, fn) -> None:  # noqa: ANN001
        before = allocated()
        kept = fn()
        extra = allocated() - before - sum(t.nbytes for t in kept)
        seen.append(extra)
        print(f"{label:<52} {extra:>12,} bytes beyond the results ({extra / 2**20:.1f} MiB); total now {allocated():,}")

    delta("fp32 matmul, main thread (first)", lambda: [a @ b])
    delta("fp32 matmul, main thread (second)", lambda: [a @ b])
    a16, b16 = a.bfloat16(), b.bfloat16()
    delta("bf16 matmul, main thread", lambda: [a16 @ b16])
    lin = torch.nn.Linear(n, n, device="cuda", dtype=torch.bfloat16)
    delta("bf16 Linear with bias (addmm / cuBLASLt), main thread", lambda: [lin(a16)])
    x = torch.randn(n, n, device="cuda", requires_grad=True)
    w = torch.randn(n, n, device="cuda", requires_grad=True)

    def backward() -> list:
        (x @ w).sum().backward()
        return [x.grad, w.grad]

    delta("fp32 backward (autograd's device thread)", backward)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = (x @ w).float().sum()

    def backward16() -> list:
        x.grad = w.grad = None
        y.backward()
        return [x.grad, w.grad]

    delta("bf16 autocast backward", backward16)

    def other_thread() -> list:
        out = []
        thread = threading.Thread(target=lambda: out.append(a @ b))
        thread.start()
        thread.join()
        return out

    delta("fp32 matmul on a new Python thread", other_thread)
    stream = torch.cuda.Stream()

    def side_stream() -> list:
        with torch.cuda.stream(stream):
            out = a @ b
        return [out]

    delta("fp32 matmul on a side stream", side_stream)
    print(f"total beyond results: {sum(seen):,} bytes ({sum(seen) / 2**20:.1f} MiB)")
    torch._C._cuda_clearCublasWorkspaces()
    print(f"after torch._C._cuda_clearCublasWorkspaces(): allocated {allocated():,}")


if __name__ == "__main__":
    main()
