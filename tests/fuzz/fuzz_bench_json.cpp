// libFuzzer target for bench.json's reader, which `moeinfer plot` runs on a file written elsewhere:
// any text must be read into a result or refused with a Status, never crash, hang, overflow or
// read out of bounds. What it accepts must lay out as a plot (or be refused by name), print as a
// table and CSV, and write a JSON that reads back. Build and run with scripts/fuzz.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "bench/plot.h"
#include "moeinfer/bench.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moeinfer;
  Result<BenchResult> result = parse_bench_json(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!result.ok()) return 0;
  (void)bench_plot(*result);
  (void)result->table();
  (void)result->csv();
  if (!parse_bench_json(result->json()).ok()) __builtin_trap();  // what it wrote, it reads
  return 0;
}
