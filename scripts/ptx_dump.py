"""Registers, spills and shared memory of compiled kernels: extracts the PTX from CubeCL's CBOR
kernel cache (CACHE_DIR, e.g. the `cache_dir` of SMP_BURN_KERNELS) into OUT_DIR/<entry>_<n>.ptx
and runs `ptxas -v` on the kernels whose entry point matches REGEX (for sm_90a). A kernel at the
register limit with spills in its loop, or a ptxas warning that it serializes `wgmma`s, is
slower than its checks suggest.

Usage: python3 scripts/ptx_dump.py CACHE_DIR OUT_DIR PTXAS REGEX
  e.g. python3 scripts/ptx_dump.py /tmp/kc /tmp/ptx "$(command -v ptxas)" flash_
"""
import os, sys, glob, struct, subprocess, re
def dec(b, i):
    ib = b[i]; mt, ai = ib >> 5, ib & 31; i += 1
    if ai < 24: v = ai
    elif ai == 24: v = b[i]; i += 1
    elif ai == 25: v = struct.unpack('>H', b[i:i+2])[0]; i += 2
    elif ai == 26: v = struct.unpack('>I', b[i:i+4])[0]; i += 4
    elif ai == 27: v = struct.unpack('>Q', b[i:i+8])[0]; i += 8
    elif ai == 31: v = None
    else: raise ValueError(ai)
    if mt == 0: return v, i
    if mt == 1: return -1 - v, i
    if mt in (2, 3):
        s = b[i:i+v]; i += v
        return (s if mt == 2 else s.decode('utf8', 'replace')), i
    if mt == 4:
        out = []
        if v is None:
            while b[i] != 0xff: x, i = dec(b, i); out.append(x)
            return out, i + 1
        for _ in range(v): x, i = dec(b, i); out.append(x)
        return out, i
    if mt == 5:
        out = {}
        if v is None:
            while b[i] != 0xff: k, i = dec(b, i); x, i = dec(b, i); out[str(k)] = x
            return out, i + 1
        for _ in range(v): k, i = dec(b, i); x, i = dec(b, i); out[str(k)] = x
        return out, i
    if mt == 6: return dec(b, i)
    if mt == 7:
        if ai == 20: return False, i
        if ai == 21: return True, i
        if ai in (22, 23): return None, i
        return v, i
def walk(o, found):
    if isinstance(o, dict):
        if 'ptx' in o and 'entrypoint_name' in o: found.append(o)
        for x in o.values(): walk(x, found)
    elif isinstance(o, list):
        for x in o: walk(x, found)
src, dst, ptxas, pat = sys.argv[1:5]
os.makedirs(dst, exist_ok=True)
found = []
for f in glob.glob(os.path.join(src, '**', '*'), recursive=True):
    if not os.path.isfile(f): continue
    b = open(f, 'rb').read(); i = 0
    try:
        while i < len(b):
            o, i = dec(b, i); walk(o, found)
    except Exception as e:
        pass
print(f"{len(found)} cached kernels")
for n, e in enumerate(found):
    name = e['entrypoint_name']
    if not re.search(pat, name): continue
    ptx = e['ptx']; ptx = bytes((x + 256) % 256 for x in ptx).rstrip(b'\0') if isinstance(ptx, list) else ptx
    p = os.path.join(dst, f"{name[:60]}_{n}.ptx"); open(p, 'wb').write(ptx)
    r = subprocess.run([ptxas, '-v', '--gpu-name', 'sm_90a', p, '-o', '/dev/null'], capture_output=True, text=True)
    info = ' '.join(l.split('info    : ')[-1] for l in r.stderr.splitlines() if 'Used' in l or 'spill' in l or 'stack' in l)
    print(f"{name[:70]} smem={e.get('shared_mem_bytes')}: {info} [{os.path.basename(p)}]")
    # ptxas warns when it must serialize `wgmma`s (registers an in-flight one reads touched).
    for l in r.stderr.splitlines():
        if 'arning' in l or 'wgmma' in l:
            print('  ptxas:', l[:300])
