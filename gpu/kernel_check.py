"""One real exllamav3 kernel on the GPU, from the installed wheel: exllamav3_ext.rms_norm on a
half-precision tensor in device memory, compared with the same RMSNorm computed by torch.

Usage: VENV/bin/python gpu/kernel_check.py     (prints one JSON line; exit 1 on a mismatch)
"""

import importlib
import json
import sys

import torch

# After torch: the extension links against the libraries torch's import loads.
exllamav3_ext = importlib.import_module("exllamav3_ext")

torch.manual_seed(0)
rows, dim, eps = 64, 4096, 1e-6
x = torch.randn(rows, dim, dtype=torch.half, device="cuda")
w = torch.randn(dim, dtype=torch.half, device="cuda")
y = torch.empty_like(x)
exllamav3_ext.rms_norm(x, w, y, eps, 0.0, 1.0, False, False)
torch.cuda.synchronize()
xf = x.float()
want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).half()
err = (y.float() - want.float()).abs().max().item()
ok = bool(torch.isfinite(y).all()) and err < 2e-2
print(json.dumps({"module": exllamav3_ext.__file__, "device": torch.cuda.get_device_name(),
                  "op": "rms_norm", "shape": [rows, dim], "max_abs_err": err, "ok": ok}))
sys.exit(0 if ok else 1)
