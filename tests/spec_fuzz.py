"""Random cuTensorMapEncodeTiled inputs as plain dicts (driver order, driver enum values), shared by the probe
that records the driver's behaviour (docs/probes/driver_record.py) and the GPU tests that compare our validator
and decoder with the driver.

  valid_inputs(rng)     meets every documented rule (the driver may still refuse: see docs/validation.md)
  boundary_inputs(rng)  a valid set pushed onto or across one to three documented boundaries
"""
import json

ELEM_BYTES = {0: 1, 1: 2, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 4, 11: 4, 12: 4}
FLOAT_TYPES = {6, 7, 8, 9, 10, 11, 12}
SWIZZLE_SPAN = {0: None, 1: 32, 2: 64, 3: 128, 4: 128, 5: 128, 6: 128}


def pick_dim(rng):
    r = rng.random()
    if r < 0.05:
        return 2**32
    if r < 0.10:
        return rng.randint(2**31, 2**32)
    if r < 0.5:
        return rng.randint(1, 64)
    return rng.randint(1, 1 << rng.randint(6, 20))


def valid_inputs(rng):
    """A random input set that meets every documented rule (for tensor ranks 1..5)."""
    dt = rng.choice(list(ELEM_BYTES))
    esize = ELEM_BYTES[dt]
    il = 0 if rng.random() < 0.85 else rng.choice([1, 2])
    rank = rng.randint(3, 5) if il else rng.randint(1, 5)
    if il == 2:
        sw = 1
    else:
        sw = rng.choice([0, 1, 2, 3]) if rng.random() < 0.9 else rng.choice([4, 5, 6])
    dims = [pick_dim(rng) for _ in range(rank)]
    align = 32 if il == 2 else 16
    strides, prev = [], dims[0] * esize
    for i in range(1, rank):
        pad = rng.choice([0, 0, 16, 48, 256])
        s = -(-prev // align) * align + pad
        if s >= 2**40:  # keep the set valid: shrink this dimension's extent instead
            s = rng.choice([align, 64 * align])
        strides.append(s)
        prev = s * dims[i]
    box = []
    for i in range(rank):
        if i == 0 and il == 0:
            span = SWIZZLE_SPAN[sw] or 256 * esize
            units = max(1, min(span, 256 * esize) // 16)
            box.append(16 * rng.randint(1, units) // esize if 16 % esize == 0 or esize == 16 else 1)
        else:
            box.append(rng.choice([1, 2, 8, 16, 32, 64, 128, 256, rng.randint(1, 256)]))
    es = [rng.randint(1, 8) if rng.random() < 0.3 else 1 for _ in range(rank)]
    oob = 1 if (dt in FLOAT_TYPES and rng.random() < 0.3) else 0
    addr = rng.randrange(1 << 32, 1 << 47) // align * align
    return {"dt": dt, "rank": rank, "addr": addr, "dims": dims, "strides": strides, "box": box,
            "es": es, "il": il, "sw": sw, "l2": rng.randint(0, 3), "oob": oob}


def mutate(rng, inp):
    """Push one field onto (or across) a documented boundary."""
    inp = json.loads(json.dumps(inp))
    rank = inp["rank"]
    if not 1 <= rank <= 5:  # already off the end; arrays no longer describe a tensor
        return inp
    esize = ELEM_BYTES[inp["dt"]]
    k = rng.randrange(17)
    i = rng.randrange(rank)
    if k == 0:
        inp["addr"] = (inp["addr"] + rng.choice([1, 2, 4, 8, 16, 24])) % 2**64
    elif k == 1:
        inp["dims"][i] = rng.choice([0, 2**32 - 1, 2**32, 2**32 + 1, 2**33])
    elif k == 2 and rank > 1:
        j = rng.randrange(rank - 1)
        inp["strides"][j] = rng.choice([inp["strides"][j] + rng.choice([1, 2, 4, 8]),
                                         2**40 - 16, 2**40, 2**40 + 16, 0, 16, 32])
    elif k == 3:
        inp["box"][i] = rng.choice([0, 1, 255, 256, 257, 512])
    elif k == 4:
        inp["box"][0] = rng.choice([1, 2, 3, 5, 7, 9, 24, 40]) if esize < 16 else 1
    elif k == 5:
        inp["es"][i] = rng.choice([0, 7, 8, 9, 16])
    elif k == 6:
        inp["il"] = rng.choice([1, 2])
    elif k == 7:
        inp["sw"] = rng.choice([0, 1, 2, 3, 4, 5, 6])
    elif k == 8:
        inp["oob"] = 1
    elif k == 9:
        inp["dt"] = rng.choice(list(ELEM_BYTES))
    elif k == 10:  # inner box bytes right at / across the swizzle span
        span = SWIZZLE_SPAN[inp["sw"]] or 128
        inp["box"][0] = max(1, (span + rng.choice([-16, 0, 16, 32])) // esize)
    elif k == 11:  # rank outside 1..5, arrays sized to match
        new_rank = rng.choice([0, 6])
        inp["rank"] = new_rank
        grow = lambda xs, v: (xs + [v] * 6)[:new_rank]
        inp["dims"] = grow(inp["dims"], 4)
        inp["strides"] = grow(inp["strides"], inp["strides"][-1] * 4 if inp["strides"] else 4096)[:max(new_rank - 1, 0)]
        inp["box"] = grow(inp["box"], 1)
        inp["es"] = grow(inp["es"], 1)
    elif k == 12 and rank > 2:  # strides out of order (outer stride smaller than inner)
        inp["strides"][0], inp["strides"][1] = inp["strides"][1], inp["strides"][0]
    elif k == 13:  # box larger than the tensor
        inp["dims"][i] = max(1, inp["box"][i] // 2)
    elif k == 14 and rank > 1:  # stride smaller than the row it steps over
        inp["strides"][0] = 16
    elif k == 15:  # elem stride larger than box
        inp["es"][i] = 8
        inp["box"][i] = min(inp["box"][i], 4) if i else inp["box"][i]
    elif k == 16:
        inp["addr"] = rng.choice([0, 16, 2**63, 2**64 - 16])
    return inp


def boundary_inputs(rng):
    inp = valid_inputs(rng)
    for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
        inp = mutate(rng, inp)
    return inp



def to_spec(inp):
    """The TensorMapSpec for an input dict (raises TypeError/ValueError like any other spec)."""
    from torch_tma import TensorMapSpec
    return TensorMapSpec(data_type=inp["dt"], address=inp["addr"], dims=inp["dims"], strides=inp["strides"],
                         box=inp["box"], elem_strides=inp["es"], interleave=inp["il"], swizzle=inp["sw"],
                         l2_promotion=inp["l2"], oob_fill=inp["oob"])
