// moeinfer bench's outputs: the routings' names, the terminal table, the CSV, and the JSON with
// its reader (which `moeinfer plot` uses on a file written elsewhere). Apart from the run itself
// (bench.cpp), so that the reader builds alone, as the fuzz target fuzz_bench_json.cpp does.
#include "moeinfer/bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>

namespace moeinfer {

const char* token_routing_name(TokenRouting r) {
  return r == TokenRouting::kIndependent ? "independent" : "correlated";
}

Result<TokenRouting> parse_token_routing(std::string_view name) {
  if (name == "independent") return TokenRouting::kIndependent;
  if (name == "correlated") return TokenRouting::kCorrelated;
  return invalid_argument(fmt::format("unknown routing '{}' (expected independent or correlated)", name));
}

std::string BenchResult::table() const {
  // Expert-parallel rows add the ranks, the most bytes one rank reads, and the all-reduce; every
  // row ends with its config: on CUDA the kernels each call launched, on the CPU its inner loop
  // and threads.
  const bool ep = std::any_of(rows.begin(), rows.end(), [](const BenchRow& r) { return r.ranks > 0; });
  const bool configs = std::any_of(rows.begin(), rows.end(), [](const BenchRow& r) { return !r.config.empty(); });
  const bool peak = peak_gflops > 0.0;
  std::string s = fmt::format("device {}, measured read bandwidth {:.0f} GB/s, compute peak {}{}\n", device, read_gbps,
                              !peak                ? std::string()
                              : peak_gflops >= 1e4 ? fmt::format("{:.0f} TFLOP/s ", peak_gflops / 1e3)
                                                   : fmt::format("{:.1f} GFLOP/s ", peak_gflops),
                              peak ? "(" + peak_how + ")" : peak_how);
  s += fmt::format("{:<20} {:<11} {:<11} {:>4} {:<11} {:>10} {:>8} {:>9} {:>8} {:>9} {:>6} {:>8} {:>10} {:>7} {:>7}",
                   "preset", "format", "routing", "N", "path", "time us", "experts", "MB", "GB/s", "floor us", "floor",
                   "GFLOP", "compute us", "compute", "bound");
  if (ep) s += fmt::format(" {:>5} {:>8} {:>12}", "ranks", "rank MB", "allreduce us");
  s += configs ? "  config\n" : "\n";
  for (const BenchRow& r : rows) {
    s += fmt::format("{:<20} {:<11} {:<11} {:>4} {:<11} {:>10.1f} {:>8.1f} {:>9.2f} {:>8.0f} {:>9.1f} {:>5.0f}%",
                     r.preset, r.format, r.routing, r.tokens, r.path, r.time_us, r.distinct_experts, r.bytes / 1e6,
                     r.gbps, r.floor_us, r.fraction * 100.0);
    if (peak) {
      s += fmt::format(" {:>8.2f} {:>10.1f} {:>6.0f}% {:>7}", r.flops / 1e9, r.compute_us, r.compute_fraction * 100.0,
                       r.bound);
    } else {
      s += fmt::format(" {:>8.2f} {:>10} {:>7} {:>7}", r.flops / 1e9, "-", "-", "-");
    }
    if (ep) s += fmt::format(" {:>5} {:>8.2f} {:>12.1f}", r.ranks, r.rank_bytes / 1e6, r.allreduce_us);
    s += configs ? "  " + r.config + "\n" : "\n";
  }
  // A row past its floor read faster than the bandwidth measured once at the start: on a shared
  // machine that measurement can come out low (a 2-core CI machine: 29-31 GB/s idle, 13 with a
  // build beside the bench), or the row's bytes came from caches. Either way its fraction overstates.
  int past = 0;
  double most = 0.0;
  for (const BenchRow& r : rows) {
    if (r.fraction > 1.0) ++past, most = std::max(most, r.fraction);
  }
  if (past > 0) {
    s += fmt::format(
        "note: {} row{} ran past the byte floor (up to {:.0f}% of it): the read bandwidth measured at the start "
        "({:.0f} GB/s) understates what {} saw (a busier machine when it was measured, or bytes served from "
        "caches), so {} fraction{} overstate{}\n",
        past, past == 1 ? "" : "s", most * 100.0, read_gbps, past == 1 ? "that row" : "those rows",
        past == 1 ? "its" : "their", past == 1 ? "" : "s", past == 1 ? "s" : "");
  }
  return s;
}

namespace {

// The JSON keys of a result and of its rows, each with its member and whether reading a file
// requires it (files from before the compute floor lack the rest), in one list for the writer
// and the reader. `visit(key, member, required)`; Result and Row may be const.
template <class Result, class Visit>
void visit_result_fields(Result& r, Visit&& visit) {
  visit("device", r.device, true);
  visit("read_gbps", r.read_gbps, true);
  visit("peak_gflops", r.peak_gflops, false);
  visit("peak_how", r.peak_how, false);
}

template <class Row, class Visit>
void visit_row_fields(Row& r, Visit&& visit) {
  visit("preset", r.preset, true);
  visit("format", r.format, true);
  visit("routing", r.routing, true);
  visit("tokens", r.tokens, true);
  visit("fraction", r.fraction, true);
  visit("backend", r.backend, false);
  visit("path", r.path, false);
  visit("config", r.config, false);
  visit("plan", r.plan, false);
  visit("time_us", r.time_us, false);
  visit("distinct_experts", r.distinct_experts, false);
  visit("bytes", r.bytes, false);
  visit("gbps", r.gbps, false);
  visit("floor_us", r.floor_us, false);
  visit("flops", r.flops, false);
  visit("compute_us", r.compute_us, false);
  visit("compute_fraction", r.compute_fraction, false);
  visit("bound", r.bound, false);
  visit("ranks", r.ranks, false);
  visit("rank_bytes", r.rank_bytes, false);
  visit("allreduce_us", r.allreduce_us, false);
}

// Copies o[key] into `out` when the types agree; a missing key is an error only when required.
// Every number of a bench result is a count or a measurement, so none may be negative, and an
// integer must fit its field. `where` names the object in the error.
template <class T>
Status read_field(const nlohmann::json& o, const std::string& where, const char* key, T& out, bool required) {
  const auto it = o.find(key);
  if (it == o.end()) return required ? invalid_argument(fmt::format("{} has no '{}'", where, key)) : Status::ok_status();
  constexpr bool kString = std::is_same_v<T, std::string>, kInteger = std::is_integral_v<T>;
  const bool fits = kString ? it->is_string() : kInteger ? it->is_number_integer() : it->is_number();
  if (!fits) {
    return invalid_argument(fmt::format("{}: '{}' is {}, not {}", where, key, it->type_name(),
                                        kString ? "a string" : kInteger ? "an integer" : "a number"));
  }
  if constexpr (kInteger) {
    const bool negative = !it->is_number_unsigned() && it->template get<int64_t>() < 0;
    if (negative) return invalid_argument(fmt::format("{}: '{}' is {}, a negative count", where, key, it->dump()));
    if (it->template get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<T>::max())) {
      return invalid_argument(fmt::format("{}: '{}' is {}, past the largest it can be ({})", where, key, it->dump(),
                                          std::numeric_limits<T>::max()));
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    if (it->template get<double>() < 0.0) {
      return invalid_argument(fmt::format("{}: '{}' is {}, a negative measurement", where, key, it->dump()));
    }
  }
  out = it->template get<T>();
  return Status::ok_status();
}

}  // namespace

std::string BenchResult::json() const {
  nlohmann::json j = nlohmann::json::object();
  const auto write = [](nlohmann::json& o) { return [&o](const char* key, const auto& v, bool) { o[key] = v; }; };
  visit_result_fields(*this, write(j));
  j["rows"] = nlohmann::json::array();
  for (const BenchRow& r : rows) {
    nlohmann::json o = nlohmann::json::object();
    visit_row_fields(r, write(o));
    j["rows"].push_back(std::move(o));
  }
  return j.dump(2) + "\n";
}

Result<BenchResult> parse_bench_json(std::string_view text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument(fmt::format("bench JSON does not parse: {}", e.what()));
  }
  if (!j.is_object()) return invalid_argument("bench JSON: the top level is not an object");
  Status first;  // the first field that could not be read
  const auto read = [&first](const nlohmann::json& o, const std::string& where) {
    return [&first, &o, where](const char* key, auto& out, bool required) {
      if (first.ok()) first = read_field(o, where, key, out, required);
    };
  };
  BenchResult result;
  visit_result_fields(result, read(j, "bench JSON"));
  if (!first.ok()) return first;
  const auto rows = j.find("rows");
  if (rows == j.end() || !rows->is_array()) return invalid_argument("bench JSON has no 'rows' array");
  for (size_t i = 0; i < rows->size(); ++i) {
    const nlohmann::json& o = (*rows)[i];
    const std::string where = fmt::format("bench JSON row {}", i);
    if (!o.is_object()) return invalid_argument(where + " is not an object");
    BenchRow r;
    visit_row_fields(r, read(o, where));
    if (!first.ok()) return first;
    if (r.tokens < 1) return invalid_argument(fmt::format("{}: 'tokens' is 0, not a token count of at least 1", where));
    result.rows.push_back(std::move(r));
  }
  return result;
}

std::string BenchResult::csv() const {
  std::string s =
      "preset,format,routing,tokens,backend,path,config,time_us,distinct_experts,bytes,gbps,floor_us,fraction,read_gbps,"
      "ranks,rank_bytes,allreduce_us,plan,flops,compute_us,compute_fraction,bound,peak_gflops\n";
  for (const BenchRow& r : rows) {
    s += fmt::format("{},{},{},{},{},{},\"{}\",{:.3f},{:.2f},{:.0f},{:.1f},{:.3f},{:.4f},{:.0f},{},{:.0f},{:.3f},\"{}\",",
                     r.preset, r.format, r.routing, r.tokens, r.backend, r.path, r.config, r.time_us, r.distinct_experts,
                     r.bytes, r.gbps, r.floor_us, r.fraction, read_gbps, r.ranks, r.rank_bytes, r.allreduce_us, r.plan);
    s += fmt::format("{:.0f},{:.3f},{:.4f},{},{:.1f}\n", r.flops, r.compute_us, r.compute_fraction, r.bound, peak_gflops);
  }
  return s;
}

}  // namespace moeinfer
