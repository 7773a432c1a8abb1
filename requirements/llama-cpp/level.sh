#!/bin/sh
# Prints the portable CPU level llama-cpp-python is compiled for on this host: the highest level of a
# fixed list whose features the CPU has. The level, never the host's exact CPU, keys the cached wheel,
# so a wheel built on one machine runs on every machine of the same level.
case "$(uname -m)" in
  x86_64|amd64) ;;
  *) echo generic; exit 0 ;;
esac
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
has() { case " $flags " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if has avx2 && has fma && has f16c && has bmi2 && has avx; then
  echo x86-64-v3
else
  echo x86-64-v2
fi
