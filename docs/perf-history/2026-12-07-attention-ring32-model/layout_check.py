# Address checks of sparse_mqa_ring32.cuh's producer stores and consumer reads (pure arithmetic).
kSubColBytes = 32 * 128
def tile_offset32(r, d):
    c, j = d >> 6, (d >> 3) & 7
    return c * kSubColBytes + (r >> 3) * 1024 + (r & 7) * 128 + ((j ^ (r & 7)) << 4)

for half in (0, 1):
    seen = {}
    for warp in range(4):
        for lane in range(32):
            g, q = lane >> 2, lane & 3
            row = half * 4 * kSubColBytes + warp * 1024 + g * 128          # :111 (relative)
            lo, hi = row + (((2 * q) ^ g) << 4), row + (((2 * q + 1) ^ g) << 4)
            r = 8 * warp + g                                                 # sub-tile row
            src_lane = 8 * 0 + g  # row of lane 8c+g = 32c + 8warp + g -> sub-tile row 8warp+g
            for m in range(4):
                if m < 3 or half == 0:
                    for s, a in ((0, lo + m * kSubColBytes), (1, hi + m * kSubColBytes)):
                        d = 256 * half + 64 * m + 16 * q + 8 * s   # elements d..d+7 = source bytes (fp8)
                        assert a == tile_offset32(r, d), (half, warp, lane, m, s)
                        assert a not in seen; seen[a] = (r, d)
            if half == 1:
                for n in range(2):
                    rc = q + 4 * (n ^ (g & 1))
                    a = row + 3 * kSubColBytes + ((rc ^ g) << 4)
                    d = 448 + 8 * rc
                    assert a == tile_offset32(r, d)
                    assert a not in seen; seen[a] = (r, d)
    assert len(seen) == 32 * 32, len(seen)  # 32 rows x 32 chunks of 16 B per half
    assert sorted(seen) == list(range(half * 16384, half * 16384 + 16384, 16))
print("producer: every 16-byte chunk of both halves written exactly once at tile_offset32(row, d)")

# mask bits: lane l<16 of warp w holds row 32*((l>>3)&1) + 8w + (l&7); byte w of sb's word = bits 8c..8c+7
for w in range(4):
    for l in range(16):
        row = 32 * ((l >> 3) & 1) + 8 * w + (l & 7)
        c = row // 32; key = row % 32
        bit_in_ballot = l; byte = (bit_in_ballot >> 3)
        assert byte == c
        assert 8 * w + (bit_in_ballot & 7) == key
print("mask: bit 8w+j of sub-tile c's word is sub-tile row 8w+j (the key of S column 8w+j)")

# S fragment keys (m64n32): d[i], i = 4j+e: col 8j + 2q + (e&1); mask_and_max key = 8(k>>2)+2q+(k&1)
for q in range(4):
    for k in range(16):
        j, e = k >> 2, k & 3
        assert 8 * j + 2 * q + (e & 1) == 8 * (k >> 2) + 2 * q + (k & 1)
# pa / A fragment (m64nNk16 RS): a0 (row g, k 2q..), a1 (row g+8, k 2q..), a2 (row g, k 2q+8..), a3 (row g+8, k 2q+8..)
for kk in range(2):
    for q in range(4):
        want = [(0, 16 * kk + 2 * q), (8, 16 * kk + 2 * q), (0, 16 * kk + 8 + 2 * q), (8, 16 * kk + 8 + 2 * q)]
        got = []
        for i, base in enumerate((8 * kk + 0, 8 * kk + 2, 8 * kk + 4, 8 * kk + 6)):
            j, e = base >> 2, base & 3
            got.append((8 * ((e >> 1) & 1), 8 * j + 2 * q + (e & 1)))
        assert got == want, (kk, q, got, want)
print("S accumulator keys, mask keys and the PV A fragments agree (16 values, 2 k-steps)")
