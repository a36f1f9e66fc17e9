// moeinfer_make_checkpoint DIR FAMILY LAYOUT: writes a tiny checkpoint of that family (a name in
// testing::families()) and
// layout (tests/checkpoint_writer.h) plus DIR/input.safetensors with hidden_states [5, H], for the
// command-line tests.
#include <fmt/format.h>

#include <string>

#include "checkpoint_writer.h"
#include "moeinfer/presets.h"
#include "moeinfer/safetensors.h"

int main(int argc, char** argv) {
  using namespace moeinfer;
  if (argc != 4) {
    fmt::print(stderr, "usage: moeinfer_make_checkpoint DIR MODEL_TYPE LAYOUT\n");
    return 2;
  }
  const std::string dir = argv[1], model_type = argv[2], layout_arg = argv[3];
  testing::Layout layout = testing::Layout::kBf16;
  bool known = false;
  for (testing::Layout l : {testing::Layout::kBf16, testing::Layout::kModelOptNvfp4, testing::Layout::kModelOptNvfp4Hf,
                            testing::Layout::kCompressedNvfp4, testing::Layout::kDeepseekFp8}) {
    if (layout_arg == testing::layout_name(l)) {
      layout = l;
      known = true;
    }
  }
  if (!known) {
    fmt::print(stderr, "unknown layout {}\n", layout_arg);
    return 2;
  }
  const testing::FamilyCase* fc = nullptr;
  static const std::vector<testing::FamilyCase> table = testing::families();
  for (const testing::FamilyCase& f : table) {
    if (model_type == f.name) fc = &f;
  }
  if (fc == nullptr) {
    fmt::print(stderr, "model type {} is not in the test family table\n", model_type);
    return 2;
  }
  const Family family = fc->family;
  const FamilyShape shape = fc->shape;
  Result<Layer> layer = make_synthetic_layer(family_layer(family, shape), testing::layout_spec(layout), 9);
  if (!layer.ok()) {
    fmt::print(stderr, "{}\n", layer.status().to_string());
    return 1;
  }
  Status st = testing::write_test_checkpoint(dir, *layer, {fc->model_type, layout, 2});
  if (st.ok()) {
    const std::vector<float> x = make_tokens(5, shape.hidden, 4);
    st = write_safetensors(dir + "/input.safetensors", {tensor_from_floats("hidden_states", {5, shape.hidden}, x, Dtype::kBF16)});
  }
  if (!st.ok()) {
    fmt::print(stderr, "{}\n", st.to_string());
    return 1;
  }
  return 0;
}
