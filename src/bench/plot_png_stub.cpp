// bench.png in a build without cairo: the bench still writes its JSON and CSV, and says why there
// is no PNG.
#include "moeinfer/bench.h"

namespace moeinfer {

Status write_bench_png(const BenchResult&, const std::string& path) {
  return unavailable(path + " not drawn: this moeinfer was built without cairo (install libcairo2-dev, "
                     "as scripts/setup does, and rebuild; `moeinfer plot` then draws it from bench.json)");
}

}  // namespace moeinfer
