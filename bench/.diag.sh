export PYTHONPATH=$PWD
g++ --version | head -1; which g++ gcc c++; python3 -c "import torch; print(torch.__config__.show())" | head -12
cat > /tmp/bad.py <<'P'
import sys, torch, pyengine.ops as ops
dev = sys.argv[1]
n = 64
p = torch.randn(n, device=dev)
try:
    ops.mean_grad_adamw_(p, torch.zeros(63, device=dev), torch.rand(n, device=dev), [torch.randn(n, device=dev)], lr=1e-3, step=1)
except Exception as e:
    print("raised OK", type(e).__name__, str(e)[:100])
P
python3 /tmp/bad.py cpu; echo "cpu rc=$?"
python3 /tmp/bad.py cuda; echo "cuda rc=$?"
timeout 120 cuda-gdb -batch -ex run -ex bt --args python3 /tmp/bad.py cuda 2>&1 | grep -v "^\[New Thread\|^\[Thread" | tail -40
