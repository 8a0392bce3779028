# epx-bench's memory guard and its records (included from tests/CMakeLists.txt).

# The run that was killed for memory on a 24 GB machine, told it has 4 GB: refused before anything
# runs (at once: a broken guard would start the run and time out), with the estimate and a
# smaller --tokens that fits.
add_test(NAME bench_memory_refused
         COMMAND epx-bench --backend host --ranks 4 --preset ll --tokens 512 --max-memory-gb 4)
set_tests_properties(bench_memory_refused PROPERTIES TIMEOUT 5
  PASS_REGULAR_EXPRESSION "refusing to run: it needs about [0-9.]+ GB of host memory at its peak .*4.00 GB is available \\(--max-memory-gb\\).*Smaller settings that fit: --tokens [1-9][0-9]*")

# The same with room to spare: not refused (the guard must not stop runs that fit). --ops
# dispatch at one wire, layout and iteration keeps it short.
add_test(NAME bench_memory_fits
         COMMAND epx-bench --backend host --ranks 2 --preset ll --tokens 8 --hidden 512 --ops dispatch --wire bf16
                 --layout rank_major --iters 1 --warmup 0 --max-memory-gb 1)
set_tests_properties(bench_memory_fits PROPERTIES TIMEOUT 60 PASS_REGULAR_EXPRESSION "all results verified"
                     FAIL_REGULAR_EXPRESSION "refusing")

# Each record on disk as soon as it is measured: 2 layouts x 2 wires, 10 records (the four ops at
# the first wire, dispatch at the second), every table row in the JSON file by the time it shows.
find_package(Python3 REQUIRED COMPONENTS Interpreter)  # scripts/setup.sh installs python3
set(EPX_BENCH_SMALL --backend host --ranks 2 --tokens 256 --hidden 1024 --experts 16 --topk 4 --iters 20
    --wire bf16,fp8 --layout expert_major,rank_major)
add_test(NAME bench_records_all
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/bench_records_check.py all
                 ${CMAKE_CURRENT_BINARY_DIR}/bench_records_all.json 10
                 -- $<TARGET_FILE:epx-bench> ${EPX_BENCH_SMALL} --json ${CMAKE_CURRENT_BINARY_DIR}/bench_records_all.json)
# Killed after its first record, with nine to go: the file still holds that one, whole.
add_test(NAME bench_records_killed
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/bench_records_check.py killed
                 ${CMAKE_CURRENT_BINARY_DIR}/bench_records_killed.json 10
                 -- $<TARGET_FILE:epx-bench> ${EPX_BENCH_SMALL} --json ${CMAKE_CURRENT_BINARY_DIR}/bench_records_killed.json)
set_tests_properties(bench_records_all bench_records_killed PROPERTIES TIMEOUT 120 PASS_REGULAR_EXPRESSION "OK: ")

# Redundant experts (--replicas): every op, both layouts and low-latency mode verified against the
# plain problem of N * E experts in the replica rule's routing (docs/benchmarks.md).
add_test(NAME bench_replicas
         COMMAND epx-bench --backend host --ranks 4 --preset ll --tokens 32 --hidden 256 --experts 16 --topk 4
                 --replicas 2 --wire bf16,fp8 --iters 1 --warmup 0)
set_tests_properties(bench_replicas PROPERTIES TIMEOUT 60 PASS_REGULAR_EXPRESSION "all results verified"
                     FAIL_REGULAR_EXPRESSION "VERIFICATION FAILED")

# The fused shared expert (--shared-expert): the expert-major ops and low-latency mode verified
# against the reference, the shared expert's rows and sum terms included.
add_test(NAME bench_shared_expert
         COMMAND epx-bench --backend host --ranks 3 --preset ll --tokens 24 --hidden 256 --experts 12 --topk 4
                 --shared-expert --wire bf16,nvfp4 --iters 1 --warmup 0)
set_tests_properties(bench_shared_expert PROPERTIES TIMEOUT 60 PASS_REGULAR_EXPRESSION "all results verified"
                     FAIL_REGULAR_EXPRESSION "VERIFICATION FAILED")

# The performance targets' report (tools/bench/check_targets.py) on made-up records.
add_test(NAME bench_check_targets COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/check_targets_test.py)
set_tests_properties(bench_check_targets PROPERTIES TIMEOUT 60 PASS_REGULAR_EXPRESSION "OK: check_targets.py")

# --mode capacity: the high-throughput buffers in capacity mode, every op and both layouts verified
# against the reference, at the exact row bound and with rows that overflow (the rows past
# capacity_rows dropped, as the reference says).
add_test(NAME bench_capacity_mode
         COMMAND epx-bench --backend host --ranks 3 --tokens 48 --hidden 256 --experts 12 --topk 4 --mode capacity
                 --wire bf16,fp8 --iters 1 --warmup 0)
add_test(NAME bench_capacity_mode_overflow
         COMMAND epx-bench --backend host --ranks 3 --tokens 48 --hidden 256 --experts 12 --topk 4 --mode capacity
                 --capacity-rows 50 --wire bf16 --iters 1 --warmup 0)
set_tests_properties(bench_capacity_mode bench_capacity_mode_overflow PROPERTIES TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "all results verified" FAIL_REGULAR_EXPRESSION "VERIFICATION FAILED")
