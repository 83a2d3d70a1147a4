# attention.cu as C++ for emu.h (tools/attention_emu): the CUDA headers become
# emu.h, the three inline-PTX wrappers (ldmatrix x4, its .trans form, mma
# m16n8k16 bf16) call the emulations, shared memory and launches go through
# the emulator. usage: transform.py attention.cu out.cpp
import re, sys
s = open(sys.argv[1]).read()
s = s.replace('#include <cuda_bf16.h>\n#include <cuda_runtime.h>\n', '#include "emu.h"\n')
def repl_fn(s, name, body):
    head = r'(__device__ __forceinline__ void ' + name + r'\([^)]*\)[^{]*\{\n)'
    m = re.search(head + r'(.*?)(\n\}\n)', s, re.S)
    assert m, name
    return s[:m.end(1)] + body + s[m.start(3):]
s = repl_fn(s, 'ldsm_x4', '  emu_ldsm(r, p, false);')
s = repl_fn(s, 'ldsm_x4_t', '  emu_ldsm(r, p, true);')
s = repl_fn(s, 'mma_bf16', '  emu_mma(c, a, b0, b1);')
n = s.count('extern __shared__ __align__(16) unsigned char smem[];')
assert n == 6, n
s = s.replace('extern __shared__ __align__(16) unsigned char smem[];',
              'unsigned char *smem = emu_smem_ptr;')
s, k = re.subn(r'(\w+)<<<(.*?)>>>\(', r'emu_launch(\1, \2, ', s, flags=re.S)
assert k == 2, k
open(sys.argv[2], 'w').write(s)
