export NCCL_NVLS_ENABLE=0; O=$OUT
make -j16 lib build/bin/epx_test build/bin/epx_bench > $O/build.log 2>&1 || { tail -30 $O/build.log; exit 1; }
timeout 280 build/bin/epx_test --ranks 2,4 --filter ll_ > $O/ll-tests.log 2>&1; echo "ll tests rc=$?"; grep -E "^\[ FAIL|FAILED" $O/ll-tests.log | head -30; tail -1 $O/ll-tests.log
timeout 100 build/bin/epx_test --ranks 2,4 --filter trace > $O/trace-tests.log 2>&1; grep -E "^\[ FAIL|FAILED|spread" $O/trace-tests.log | head; tail -1 $O/trace-tests.log
timeout 120 build/bin/epx_bench --rows ll --iters 50 --warmup 10 --sms 24 > $O/ll-bench.log 2>&1; echo "ll bench rc=$?"; grep -vE "^#" $O/ll-bench.log | head -60
mkdir -p /tmp/tr; timeout 100 build/bin/epx_bench --rows normal --tokens 4096 --epx-sms 24 --sms 24 --trace /tmp/tr/t.json > /tmp/tr/b.log 2>&1; echo "trace bench rc=$?"
python3 scripts/trace-summary.py /tmp/tr/t-dispatch_bf16-4096t-24sms.json /tmp/tr/t-combine-4096t-24sms.json > $O/trace-summary.txt 2>&1; gzip -c /tmp/tr/t-combine-4096t-24sms.json > $O/combine-trace.json.gz
