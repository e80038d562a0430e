#!/bin/bash
python -m ds4 model=v4_flash model.n_layers=4 max_new_tokens=2 tracking=none hydra.run.dir=/tmp/cli4out > /tmp/cli4.log 2>&1 &
pid=$!
peak=0
while kill -0 $pid 2>/dev/null; do
  r=$(awk '/VmRSS/{print $2}' /proc/$pid/status 2>/dev/null); r=${r:-0}
  [ "$r" -gt "$peak" ] && peak=$r
  if [ "$r" -gt 22800000 ]; then echo "killed at $r KiB" >> /tmp/cli4.watch; kill $pid; fi
  sleep 2
done
echo "watch peak $peak KiB" >> /tmp/cli4.watch
