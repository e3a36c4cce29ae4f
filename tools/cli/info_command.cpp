// `cumulus info --model PATH [--tokenizer PATH]`: what a model file holds -- format,
// architecture, hyperparameters, tensor types, tokenizer -- without loading the weights.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cli.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/simd.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/tokenizer.h"

namespace cumulus::cli {
namespace {

struct InfoOptions {
  std::string model;
  std::string tokenizer;  // llama2.c only; found next to the model when empty
};

void print_config(const ModelConfig& c) {
  fmt::print("architecture   {}\n", c.architecture);
  fmt::print("layers         {}\n", c.n_layers);
  fmt::print("dim            {} (feed-forward {})\n", c.dim, c.hidden_dim);
  fmt::print("heads          {} query over {} kv (group {}), head_dim {}\n", c.n_heads, c.n_kv_heads,
             c.n_heads / c.n_kv_heads, c.head_dim);
  fmt::print("context        {}\n", c.context_length);
  fmt::print("vocab          {}\n", c.vocab_size);
  fmt::print("rope           theta {}, {} dims per head, {}\n", c.rope_theta, c.rope_dim,
             c.rope_neox ? "halves (NEOX)" : "adjacent pairs");
  fmt::print("rms eps        {}\n", c.rms_eps);
  if (!c.layer_local.empty()) {
    std::vector<int> global;
    for (int l = 0; l < c.n_layers; ++l)
      if (!c.is_local(l)) global.push_back(l);
    fmt::print("layers         {} local (sliding window {}, rope theta {}), global: {}\n", c.n_layers - c.n_global_layers(),
               c.sliding_window, c.rope_theta_local, fmt::join(global, ", "));
  }
  if (c.architecture == "gemma3")
    fmt::print("gemma3         embedding x {:.4g}, q/k norms, post norms, gelu (tanh) FFN, attention scale {:.4g}{}\n",
               c.embedding_scale, c.attention_scale,
               c.logit_softcap > 0 ? fmt::format(", logit soft-cap {}", c.logit_softcap) : std::string());
  fmt::print("output head    {}\n", c.tied_output ? "tied to token embeddings" : "separate");
}

void print_tokenizer(const Tokenizer& t) {
  auto describe = [&](int32_t id) {
    if (id < 0) return std::string("none");
    std::string text = t.token_text(id);
    for (auto& ch : text)
      if (ch == '\n') ch = ' ';
    return fmt::format("{} '{}'", id, text);
  };
  fmt::print("tokenizer      {}, {} tokens\n", tokenizer_kind_name(t.kind()), t.vocab_size());
  fmt::print("special        bos {}, eos {}, add bos {}\n", describe(t.bos_id()), describe(t.eos_id()),
             t.add_bos_default() ? "yes" : "no");
}

void run_info(const InfoOptions& o) {
  fmt::print("device         cpu (default); {}\n", device_line());
  fmt::print("cpu simd       {} (compiled: {}; CUMULUS_SIMD=<target> caps it)\n", cpu::simd_target_line(),
             fmt::join(cpu::simd_targets_compiled(), ", "));
  fmt::print("model          {}\n", o.model);
  if (model_format_of(o.model) == ModelFormat::gguf) {
    const GgufFile f = GgufFile::open(o.model);
    fmt::print("format         GGUF v{}, {} bytes, {} metadata keys, {} tensors, alignment {}\n", f.version(),
               f.file_size(), f.metadata().size(), f.tensors().size(), f.alignment());
    if (const GgufValue* name = f.find("general.name"); name != nullptr && name->type == GgufType::string)
      fmt::print("name           {}\n", name->str);
    print_config(model_config_from_gguf(f));
    std::map<std::string_view, std::pair<size_t, uint64_t>> types;  // name -> (tensors, elements)
    uint64_t n_params = 0;
    for (const auto& t : f.tensors()) {
      auto& e = types[ggml_type_name(t.type)];
      ++e.first;
      e.second += t.n_elements;
      n_params += t.n_elements;
    }
    fmt::print("parameters     {:.1f} M\n", static_cast<double>(n_params) / 1e6);
    for (const auto& [name, e] : types)
      fmt::print("tensor type    {:<5} {:>4} tensors, {:>12} elements\n", name, e.first, e.second);
    print_tokenizer(*tokenizer_from_gguf(f));
    // What generate and eval would refuse, info refuses too (after printing what it read).
    model_weights_check(o.model);
    return;
  }
  const ModelConfig c = model_config_from_llama2c(o.model);
  fmt::print("format         llama2.c .bin (float32)\n");
  print_config(c);
  std::string tok = o.tokenizer;
  if (tok.empty()) tok = tokenizer_find_llama2c(o.model, c.vocab_size);
  if (tok.empty()) {
    fmt::print("tokenizer      none found next to the model (tok{}.bin, tokenizer.bin); pass --tokenizer\n",
               c.vocab_size);
    return;
  }
  fmt::print("tokenizer file {}\n", tok);
  print_tokenizer(*tokenizer_from_llama2c(tok, c.vocab_size));
}

}  // namespace

void add_info_command(CLI::App& app) {
  auto opts = std::make_shared<InfoOptions>();
  auto* cmd = app.add_subcommand("info", "Print a model's format, architecture, hyperparameters, tensor types and tokenizer");
  cmd->add_option("--model", opts->model, "GGUF or llama2.c .bin file")->required()->check(CLI::ExistingFile);
  cmd->add_option("--tokenizer", opts->tokenizer, "llama2.c tok*.bin (default: found next to the model)")
      ->check(CLI::ExistingFile);
  cmd->callback([opts] { run_info(*opts); });
}

}  // namespace cumulus::cli
