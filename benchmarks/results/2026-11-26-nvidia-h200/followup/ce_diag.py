import sys, torch
sys.path.insert(0, "tests")
import test_cross_entropy_kernel as t
from fastformer import reference
problem, generator = t.ce_problem(13, 37, "none", "cuda")
grad_loss = t.upstream_gradient("none", 13, generator, "cuda", "ones")
lowp = {**problem, "logits": problem["logits"].half()}
opts = dict(label_smoothing=0.0, reduction="none")
for name, fn in (("over temporary", t.cross_entropy_over_a_temporary), ("own buffer", t.cross_entropy)):
    fused = t.loss_and_grads(fn, lowp, grad_loss, ignore_index=t.IGNORE, **opts)
    exact = t.loss_and_grads(reference.cross_entropy, {**lowp, "logits": lowp["logits"].double()}, grad_loss, ignore_index=t.IGNORE, **opts)
    torch_ = t.loss_and_grads(t.torch_cross_entropy, lowp, grad_loss, **opts)
    for k in fused:
        ef = (fused[k].double() - exact[k]).abs(); et = (torch_[k].double() - exact[k]).abs()
        i = ef.flatten().argmax()
        print(name, k, "fused err", ef.max().item(), "torch err", et.max().item(), "at", i.item(),
              "fused", fused[k].flatten()[i].item(), "torch", torch_[k].flatten()[i].item(), "exact", exact[k].flatten()[i].item())
