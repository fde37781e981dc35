"""What the GPU's clocks and power did while a benchmark timed it, read from NVML.

NVML is the driver's own library (libnvidia-ml.so.1, present wherever nvidia-smi is), called here through ctypes:
the GPU machines have no network, so its Python wrapper (nvidia-ml-py, which torch.cuda.clock_rate() needs) is not
there to install. Five calls are used, all documented in the NVML API reference.

    clocks = Clocks.for_device(torch.device("cuda"))
    ...  # clocks.sample() while the GPU runs the timed work (bench_linear's replay loop calls it)
    clocks.take()  # {'sm_mhz_min': ..., 'sm_mhz_max': ..., 'mem_mhz_min': ..., 'power_w_max': ..., 'clock_events': ...}
"""

import ctypes

# nvmlClocksEventReasons bits (nvml.h): why the clocks are below their maximum at the moment of a sample
# nvml.h's nvmlClocksEventReason* bits (GpuIdle 0x1 ... DisplayClockSetting 0x100)
CLOCK_EVENTS = {0x1: "idle", 0x2: "app-clocks", 0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x10: "sync-boost",
                0x20: "sw-thermal", 0x40: "hw-thermal", 0x80: "hw-power-brake", 0x100: "display-clock"}
_NVML_CLOCK_SM, _NVML_CLOCK_MEM = 1, 2
FIELDS = ("sm_mhz_min", "sm_mhz_max", "mem_mhz_min", "power_w_max", "clock_events")


def event_names(bits: int) -> str:
    """'sw-power-cap|hw-thermal' for a reasons mask; '' for none. Unknown bits by value."""
    names = [name for bit, name in CLOCK_EVENTS.items() if bits & bit]
    rest = bits & ~sum(CLOCK_EVENTS)
    return "|".join(names + ([hex(rest)] if rest else []))


class Clocks:
    """Samples of one GPU's SM and memory clocks, power and clock-event reasons. Without NVML (no driver: a CPU
    machine) `error` says why, sample() does nothing and take() returns empty fields."""

    def __init__(self, pci_bus_id: str):
        self.samples: list[tuple[int, int, float, int]] = []
        self.error = ""
        try:
            self._nvml = ctypes.CDLL("libnvidia-ml.so.1")
            self._check(self._nvml.nvmlInit_v2(), "nvmlInit_v2")
            self._handle = ctypes.c_void_p()
            self._check(self._nvml.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(self._handle)),
                        f"nvmlDeviceGetHandleByPciBusId_v2({pci_bus_id})")
            # the name since r535; the same call under its older name before
            self._reasons = getattr(self._nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                self._nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        except (OSError, RuntimeError, AttributeError) as e:
            self.error = str(e)

    @classmethod
    def for_device(cls, device) -> "Clocks":
        import torch

        props = torch.cuda.get_device_properties(device)
        return cls(f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0")

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"NVML {what} failed with status {status}")

    def _uint(self, fn, *args) -> int:
        value = ctypes.c_uint()
        self._check(fn(self._handle, *args, ctypes.byref(value)), fn.__name__)
        return value.value

    def sample(self) -> None:
        """One reading now: SM MHz, memory MHz, power (W, NVML's own average) and the clock-event reasons."""
        if self.error:
            return
        reasons = ctypes.c_ulonglong()
        self._check(self._reasons(self._handle, ctypes.byref(reasons)), self._reasons.__name__)
        self.samples.append((self._uint(self._nvml.nvmlDeviceGetClockInfo, _NVML_CLOCK_SM),
                             self._uint(self._nvml.nvmlDeviceGetClockInfo, _NVML_CLOCK_MEM),
                             self._uint(self._nvml.nvmlDeviceGetPowerUsage) / 1e3, reasons.value))

    def take(self) -> dict:
        """The samples since the last take() as FIELDS (min / max, the union of the reasons), and forget them."""
        samples, self.samples = self.samples, []
        if not samples:
            return dict.fromkeys(FIELDS, "")
        sm, mem, power, reasons = zip(*samples)
        bits = 0
        for r in reasons:
            bits |= r
        return {"sm_mhz_min": min(sm), "sm_mhz_max": max(sm), "mem_mhz_min": min(mem),
                "power_w_max": f"{max(power):.0f}", "clock_events": event_names(bits)}


def main():
    import argparse
    import time

    import torch

    parser = argparse.ArgumentParser(description="Print the GPU's SM and memory clocks, power and clock-event "
                                                 "reasons (NVML) every --interval seconds for --seconds.")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args()
    clocks = Clocks.for_device(torch.device("cuda"))
    if clocks.error:
        raise SystemExit(f"no NVML: {clocks.error}")
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        clocks.sample()
        print(clocks.take(), flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    main()
