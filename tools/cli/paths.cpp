// Path checks shared by the commands (paths.h).
#include "paths.h"

#include <array>
#include <string_view>

#include "core/check.h"
#include "cumulus/core/error.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/quant.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/tokenizer.h"

namespace cumulus::cli {

void paths_refuse_empty(CLI::App& app) {
  static constexpr std::array<std::string_view, 11> kPathOptions = {
      "--model", "--tokenizer", "--prompt-file", "--text", "--json", "--markdown",
      "--svg-dir", "--kv-save", "--kv-load", "--out", "--profile"};
  const CLI::Validator nonempty(
      [](std::string& s) -> std::string {
        return s.empty() ? "an empty path is not allowed (an unset variable?): give a path or leave the option out"
                         : std::string();
      },
      "PATH");
  for (CLI::App* sub : app.get_subcommands({}))
    for (CLI::Option* opt : sub->get_options())
      for (std::string_view name : kPathOptions)
        if (opt->check_lname(std::string(name.substr(2)))) opt->check(nonempty);
}

void paths_check_distinct(std::vector<FilePathUse> paths) {
  std::string model, tokenizer;
  for (const FilePathUse& p : paths) {
    if (p.what == "--model") model = p.path;
    if (p.what == "--tokenizer") tokenizer = p.path;
  }
  if (!model.empty() && tokenizer.empty()) {
    try {  // a model that cannot be read is named by the model checks that follow
      if (model_format_of(model) == ModelFormat::llama2c) {
        const std::string found = tokenizer_find_llama2c(model, model_config_from_llama2c(model).vocab_size);
        if (!found.empty()) paths.push_back({"the tokenizer found beside --model", found, false});
      }
    } catch (const Error&) {
    }
  }
  file_check_distinct(paths);
}

void snapshot_weights_check(const std::string& snapshot_path, const std::string& setup, const std::string& model,
                            const std::string& weights) {
  if (setup.rfind("weights=", 0) != 0) return;  // the session's own check names it
  const std::string saved = setup.substr(8, setup.find(' ') == std::string::npos ? std::string::npos
                                                                                 : setup.find(' ') - 8);
  bool quantised = false;  // does --weights compact keep a block format of this model?
  if (model_format_of(model) == ModelFormat::gguf) {
    const GgufFile f = GgufFile::open(model);
    for (const auto& t : f.tensors())
      for (GgmlType kept : {GgmlType::q4_0, GgmlType::q4_1, GgmlType::q5_0, GgmlType::q5_1, GgmlType::q8_0,
                            GgmlType::q4_k, GgmlType::q5_k, GgmlType::q6_k})
        quantised = quantised || t.type == kept;
  }
  const bool saved_f32 = saved == "F32";
  const bool run_f32 = weights == "f32" || !quantised;
  CUMULUS_CHECK(saved_f32 == run_f32,
                "--kv-load '{}' was saved with weights={} but --weights {} keeps this model's weights as {}: its "
                "cache would not match; use --weights {}",
                snapshot_path, saved, weights, run_f32 ? "F32" : "its block formats", saved_f32 ? "f32" : "compact");
}

}  // namespace cumulus::cli
