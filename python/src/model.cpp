// cumulus.Model: a model file and its tokenizer, and generation as `cumulus generate` does it
// (tools/cli/generate_command.cpp): the prompt encoded with the tokenizer's BOS default,
// prefilled, the method's index built, then a token sampled and decoded at a time until EOS
// or max_tokens; the result carries the text, the tokens and the run's attention summary.
// device="cuda" runs the CUDA model runtime (model/cuda_runner.h) in a CUDA build.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <variant>

#include "binding.h"
#include "cumulus/eval/method_spec.h"
#include "cumulus/methods/registry.h"
#include "cumulus/model/model_load.h"
#include "cumulus/model/runner.h"
#include "cumulus/model/sampler.h"
#include "cumulus/model/session.h"
#ifdef CUMULUS_HAVE_CUDA
#include "cumulus/model/cuda_runner.h"
#endif

namespace cumulus::python {
namespace {

// Text from the tokenizer's bytes: invalid UTF-8 (a token that splits a character) becomes
// U+FFFD rather than an exception.
nb::str text_from_bytes(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
  if (o == nullptr) throw nb::python_error();
  return nb::steal<nb::str>(o);
}

struct GenerateStats {
  std::string method, device;
  int prompt_tokens = 0, generated = 0;
  double prefill_s = 0, index_s = 0, decode_s = 0;
  double prefill_tokens_per_s = 0, decode_tokens_per_s = 0;
  double tokens_attended = 0;  // mean per head-step
  std::optional<double> claimed_mass, true_mass;
  double kv_read_fraction = 0;
  std::optional<double> kv_bytes_read;
  int64_t head_steps = 0, layer_steps = 0;
  double prefill_block_share = 1;
};

struct GenerateResult {
  nb::str text;
  std::vector<int32_t> tokens, prompt_tokens;
  std::string stop_reason;
  GenerateStats stats;
};

class Model {
 public:
  Model(const std::string& path, const std::string& device, std::optional<int> threads, const std::string& tokenizer,
        const std::string& weights, const std::string& kv_dtype, int page_size)
      : device_(device), threads_(threads.value_or(default_threads())), page_size_(page_size) {
    constexpr const char* where = "Model";
    device_check(where, device);
    if (threads_ < 1 || threads_ > 256) fail(where, "threads={} must be in [1, 256]", threads_);
    if (page_size < 1 || page_size > 256 || (page_size & (page_size - 1)) != 0)
      fail(where, "page_size={} must be a power of two in [1, 256]", page_size);
    kv_dtype_ = dtype_from_name(kv_dtype);
    WeightStorage storage = WeightStorage::compact;
    if (weights == "f32") storage = WeightStorage::f32;
    else if (weights != "compact") fail(where, "weights='{}' must be 'compact' or 'f32'", weights);
    const ModelConfig config = model_load_check(path, tokenizer);
#ifdef CUMULUS_HAVE_CUDA
    if (device == "cuda") cuda_runner_check(config, options("dense", {}, "dense", {}, false));
#else
    (void)config;
#endif
    nb::gil_scoped_release release;
    model_ = model_load(path, tokenizer, storage);
  }

  std::vector<int32_t> tokenize(const std::string& text, std::optional<bool> add_bos) const {
    return model_.tokenizer->encode(text, add_bos.value_or(model_.tokenizer->add_bos_default()));
  }

  nb::str detokenize(const std::vector<int32_t>& tokens) const {
    check_ids("Model.detokenize", tokens, "tokens");
    return text_from_bytes(model_.tokenizer->decode(tokens));
  }

  GenerateResult generate(const std::variant<std::string, std::vector<int32_t>>& prompt, int max_tokens,
                          const std::string& method, const std::optional<nb::dict>& params,
                          const std::string& prefill, const std::optional<nb::dict>& prefill_params,
                          float temperature, float top_p, uint64_t seed, bool eval, const nb::kwargs& method_params) {
    constexpr const char* where = "Model.generate";
    const ModelConfig& c = model_.weights.config;
    const Tokenizer& tok = *model_.tokenizer;
    if (max_tokens < 1) fail(where, "max_tokens={} must be >= 1", max_tokens);
    if (!(temperature >= 0) || !std::isfinite(temperature))
      fail(where, "temperature={} must be >= 0", temperature);
    if (!(top_p > 0 && top_p <= 1)) fail(where, "top_p={} must be in (0, 1]", top_p);
    const std::map<std::string, std::string> mp = decode_params(where, method, params, method_params);
    const std::map<std::string, std::string> pp =
        prefill_params ? param_strings(where, *prefill_params) : std::map<std::string, std::string>{};
    prefill_spec_check(prefill, pp);
    std::vector<int32_t> ids;
    if (const std::string* text = std::get_if<std::string>(&prompt)) {
      ids = tok.encode(*text, tok.add_bos_default());
      if (ids.empty() && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
    } else {
      ids = std::get<std::vector<int32_t>>(prompt);
      check_ids(where, ids, "prompt");
    }
    if (ids.empty()) fail(where, "the prompt is empty and the tokenizer has no BOS token");
    if (static_cast<int64_t>(ids.size()) + max_tokens > c.context_length)
      fail(where, "prompt of {} tokens + max_tokens {} exceeds the model's context of {} tokens", ids.size(),
           max_tokens, c.context_length);
    const SessionOptions so = options(method, mp, prefill, pp, eval);
#ifdef CUMULUS_HAVE_CUDA
    if (device_ == "cuda") cuda_runner_check(c, so);
#endif

    GenerateResult r;
    std::string text;
    r.prompt_tokens = ids;
    GenerateStats& st = r.stats;
    st.method = method;
    st.prompt_tokens = static_cast<int>(ids.size());
    {
      nb::gil_scoped_release release;
      using clock = std::chrono::steady_clock;
      std::unique_ptr<ModelRunner> runner = make_runner(so);
      st.device = runner->device();
      auto t0 = clock::now();
      const std::vector<float>* logits = &runner->prefill(ids);
      st.prefill_s = std::chrono::duration<double>(clock::now() - t0).count();
      t0 = clock::now();
      runner->build_indexes();
      st.index_s = std::chrono::duration<double>(clock::now() - t0).count();
      Sampler sampler({.temperature = temperature, .top_p = top_p, .seed = seed});
      double kv_bytes = 0;
      bool kv_bytes_known = true;
      r.stop_reason = "length";
      // As the CLI's decode loop: the token sampled from the last logits is not decoded.
      for (int i = 0; i < max_tokens; ++i) {
        const auto t = clock::now();
        const int32_t next = sampler.sample(*logits);
        if (next == tok.eos_id()) {
          st.decode_s += std::chrono::duration<double>(clock::now() - t).count();
          r.stop_reason = "eos";
          break;
        }
        r.tokens.push_back(next);
        if (i + 1 < max_tokens) {
          logits = &runner->decode(next);
          const std::vector<AttnOutput>& last = runner->last_step();
          if (last.empty()) kv_bytes_known = false;
          for (const AttnOutput& o : last)
            for (const StepStats& s : o.stats) kv_bytes += s.bytes_read;
        }
        st.decode_s += std::chrono::duration<double>(clock::now() - t).count();
        text += tok.decode_piece(next);
      }
      const AttentionSummary sum = runner->summary();
      st.generated = static_cast<int>(r.tokens.size());
      st.prefill_tokens_per_s = st.prefill_s > 0 ? ids.size() / st.prefill_s : 0;
      st.decode_tokens_per_s = st.generated > 1 && st.decode_s > 0 ? (st.generated - 1) / st.decode_s : 0;
      st.tokens_attended = sum.mean_tokens();
      if (sum.claimed_count) st.claimed_mass = sum.mean_claimed();
      if (sum.true_count) st.true_mass = sum.mean_true();
      st.kv_read_fraction = sum.mean_kv_fraction();
      if (kv_bytes_known && sum.layer_steps > 0) st.kv_bytes_read = kv_bytes;
      st.head_steps = sum.head_steps;
      st.layer_steps = sum.layer_steps;
      st.prefill_block_share = runner->prefill_stats().block_share();
    }
    r.text = text_from_bytes(text);
    return r;
  }

  // Teacher-forced logits: the first `prompt_tokens` ids are prefilled (dense), the method's
  // index is built, then every later id is decoded through the method in turn. Row 0 holds the
  // logits after the prompt, row i those after ids[prompt_tokens + i - 1]: [n - prompt_tokens
  // + 1, vocab] float32. What `generate` computes, with the tokens given instead of sampled.
  nb::ndarray<nb::numpy, float, nb::ndim<2>> logits(const std::vector<int32_t>& ids, std::optional<int> prompt_tokens,
                                                    const std::string& method, const std::optional<nb::dict>& params,
                                                    bool eval, const nb::kwargs& method_params) {
    constexpr const char* where = "Model.logits";
    const ModelConfig& c = model_.weights.config;
    const std::map<std::string, std::string> mp = decode_params(where, method, params, method_params);
    if (ids.empty()) fail(where, "tokens is empty");
    check_ids(where, ids, "tokens");
    const int64_t n = static_cast<int64_t>(ids.size());
    const int64_t np = prompt_tokens.value_or(static_cast<int>(n));
    if (np < 1 || np > n) fail(where, "prompt_tokens={} must be in [1, {}] (the number of tokens)", np, n);
    if (n > c.context_length) fail(where, "{} tokens exceed the model's context of {} tokens", n, c.context_length);
    const SessionOptions so = options(method, mp, "dense", {}, eval);
#ifdef CUMULUS_HAVE_CUDA
    if (device_ == "cuda") cuda_runner_check(c, so);
#endif
    const int64_t rows = n - np + 1, vocab = c.vocab_size;
    auto* data = new float[static_cast<size_t>(rows * vocab)];
    nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
    {
      nb::gil_scoped_release release;
      std::unique_ptr<ModelRunner> runner = make_runner(so);
      const std::vector<int32_t> prompt(ids.begin(), ids.begin() + np);
      const std::vector<float>* l = &runner->prefill(prompt);
      runner->build_indexes();
      for (int64_t r = 0; r < rows; ++r) {
        if (r > 0) l = &runner->decode(ids[static_cast<size_t>(np + r - 1)]);
        std::copy(l->begin(), l->end(), data + r * vocab);
      }
    }
    return nb::ndarray<nb::numpy, float, nb::ndim<2>>(data, {static_cast<size_t>(rows), static_cast<size_t>(vocab)},
                                                      owner);
  }

  const ModelConfig& config() const { return model_.weights.config; }
  const Tokenizer& tokenizer() const { return *model_.tokenizer; }
  const std::string& path() const { return model_.path; }
  const std::string& device() const { return device_; }
  int threads() const { return threads_; }

 private:
  void check_ids(const char* where, const std::vector<int32_t>& ids, const char* name) const {
    const int vocab = model_.weights.config.vocab_size;
    for (size_t i = 0; i < ids.size(); ++i)
      if (ids[i] < 0 || ids[i] >= vocab)
        fail(where, "{}[{}]={} is not a token id of this model (vocabulary of {})", name, i, ids[i], vocab);
  }

  // The decode method's parameters from `params` and keywords, parsed by the registry: before
  // any work.
  static std::map<std::string, std::string> decode_params(const char* where, const std::string& method,
                                                          const std::optional<nb::dict>& params,
                                                          const nb::kwargs& method_params) {
    std::map<std::string, std::string> mp = params ? param_strings(where, *params) : std::map<std::string, std::string>{};
    for (const auto& [k, v] : param_strings(where, method_params)) {
      if (mp.count(k)) fail(where, "method parameter '{}' given twice (in params and as a keyword)", k);
      mp[k] = v;
    }
    const MethodInfo& info = Registry::builtin().find(method);
    if (!method_kind_decodes(info.kind))
      fail(where, "method='{}' is a {} method, not a decode method (give it as prefill=)", method,
           method_kind_name(info.kind));
    Registry::builtin().parse(method, mp);
    return mp;
  }

  SessionOptions options(const std::string& method, const std::map<std::string, std::string>& params,
                         const std::string& prefill, const std::map<std::string, std::string>& prefill_params,
                         bool eval) const {
    SessionOptions so;
    so.method = method;
    so.params = params;
    so.prefill_method = prefill;
    so.prefill_params = prefill_params;
    so.n_threads = threads_;
    so.kv.page_size = page_size_;
    so.kv.dtype = kv_dtype_;
    so.eval = eval;
    return so;
  }

  std::unique_ptr<ModelRunner> make_runner(const SessionOptions& so) const {
#ifdef CUMULUS_HAVE_CUDA
    if (device_ == "cuda") return model_runner_cuda(model_.weights, so);
#endif
    return model_runner_cpu(model_.weights, so);
  }

  LoadedModel model_;
  std::string device_;
  int threads_;
  int page_size_;
  DType kv_dtype_ = DType::f16;
};

}  // namespace

void bind_model(nb::module_& mod) {
  nb::class_<GenerateStats>(mod, "GenerateStats",
                            "What a Model.generate run measured (the columns of `cumulus generate`'s table).")
      .def_ro("method", &GenerateStats::method)
      .def_ro("device", &GenerateStats::device, "'cpu' or the GPU's name")
      .def_ro("prompt_tokens", &GenerateStats::prompt_tokens)
      .def_ro("generated", &GenerateStats::generated, "tokens generated (EOS not counted)")
      .def_ro("prefill_s", &GenerateStats::prefill_s)
      .def_ro("index_s", &GenerateStats::index_s, "the decode method's index build after the prefill (0 for dense)")
      .def_ro("decode_s", &GenerateStats::decode_s, "sampling and decode steps")
      .def_ro("prefill_tokens_per_s", &GenerateStats::prefill_tokens_per_s)
      .def_ro("decode_tokens_per_s", &GenerateStats::decode_tokens_per_s,
              "(generated - 1) / decode_s, as the CLI counts it (0 for fewer than 2 tokens)")
      .def_ro("tokens_attended", &GenerateStats::tokens_attended, "mean tokens attended per head-step")
      .def_ro("claimed_mass", &GenerateStats::claimed_mass,
              "mean attention mass the method claims for what it attended; None: it makes no claim")
      .def_ro("true_mass", &GenerateStats::true_mass, "mean true mass of the attended sets (eval=True); else None")
      .def_ro("kv_read_fraction", &GenerateStats::kv_read_fraction,
              "mean share of the dense K/V bytes read per layer-step, selection included")
      .def_ro("kv_bytes_read", &GenerateStats::kv_bytes_read,
              "K/V bytes the decode steps read in all, selection included; None where the runtime does not "
              "report it per step (cuda without eval)")
      .def_ro("head_steps", &GenerateStats::head_steps)
      .def_ro("layer_steps", &GenerateStats::layer_steps)
      .def_ro("prefill_block_share", &GenerateStats::prefill_block_share,
              "share of the causal blocks the prefill method computed (1 for dense)")
      .def("__repr__", [](const GenerateStats& s) {
        return fmt::format("GenerateStats(method={}, generated={}, decode_tokens_per_s={:.1f}, tokens_attended={:.1f}, "
                           "claimed_mass={}, kv_read_fraction={:.3f})",
                           s.method, s.generated, s.decode_tokens_per_s, s.tokens_attended,
                           s.claimed_mass ? fmt::format("{:.3f}", *s.claimed_mass) : "None", s.kv_read_fraction);
      });
  nb::class_<GenerateResult>(mod, "GenerateResult", "Model.generate's result.")
      .def_ro("text", &GenerateResult::text, "the generated text (the prompt not included)")
      .def_ro("tokens", &GenerateResult::tokens, "the generated token ids")
      .def_ro("prompt_tokens", &GenerateResult::prompt_tokens, "the prompt's token ids, as prefilled")
      .def_ro("stop_reason", &GenerateResult::stop_reason, "'eos' or 'length'")
      .def_ro("stats", &GenerateResult::stats)
      .def("__repr__", [](const GenerateResult& r) {
        return fmt::format("GenerateResult(text={}, stop_reason={}, stats={})", nb::repr(r.text).c_str(),
                           r.stop_reason, nb::repr(nb::cast(r.stats)).c_str());
      });

  nb::class_<Model>(mod, "Model",
                    "A model (GGUF, or llama2.c .bin with its tokenizer) and its tokenizer, loaded once; "
                    "generate() runs it with any decode method.")
      .def(nb::init<const std::string&, const std::string&, std::optional<int>, const std::string&,
                    const std::string&, const std::string&, int>(),
           nb::arg("path"), nb::arg("device") = "cpu", nb::arg("threads") = nb::none(), nb::kw_only(),
           nb::arg("tokenizer") = "", nb::arg("weights") = "compact", nb::arg("kv_dtype") = "f16",
           nb::arg("page_size") = 16,
           "Loads the model at `path`. device: 'cpu' or 'cuda' (a CUDA build); threads: default the CPUs this "
           "process may run on, as the CLI; tokenizer: a llama2.c tok*.bin (default: found beside a .bin model; "
           "not with GGUF); weights: 'compact' (block formats stay quantised) or 'f32'; kv_dtype: 'f16', 'bf16' "
           "or 'f32'; page_size: KV cache page size.")
      .def("tokenize", &Model::tokenize, nb::arg("text"), nb::arg("add_bos") = nb::none(),
           "Text to token ids; add_bos: prepend BOS (default: the tokenizer's default).")
      .def("detokenize", &Model::detokenize, nb::arg("tokens"),
           "Token ids to text (sentencepiece drops the one leading space encode added).")
      .def("generate", &Model::generate, nb::arg("prompt"), nb::arg("max_tokens") = 64, nb::arg("method") = "dense",
           nb::kw_only(), nb::arg("params") = nb::none(), nb::arg("prefill") = "dense",
           nb::arg("prefill_params") = nb::none(), nb::arg("temperature") = 0.0f, nb::arg("top_p") = 1.0f,
           nb::arg("seed") = 0, nb::arg("eval") = false, nb::arg("method_params"),
           "Generates up to max_tokens tokens after `prompt` (text, encoded with the tokenizer's BOS default, or "
           "token ids) with the decode `method` and its parameters as keywords (p=0.9) or in `params` (for a "
           "name generate takes itself, such as tactic's seed). prefill: 'dense' or 'flexprefill' with "
           "prefill_params. temperature 0 is greedy; eval=True also measures the true mass of every attended "
           "set. Stops at EOS. The GIL is released while it runs.")
      .def("logits", &Model::logits, nb::arg("tokens"), nb::kw_only(), nb::arg("prompt_tokens") = nb::none(),
           nb::arg("method") = "dense", nb::arg("params") = nb::none(), nb::arg("eval") = false,
           nb::arg("method_params"),
           "Teacher-forced logits: the first prompt_tokens ids (default all) are prefilled densely, the method's "
           "index is built, then each later id is decoded through `method`. Returns float32 [len(tokens) - "
           "prompt_tokens + 1, vocab]: row 0 after the prompt, row i after tokens[prompt_tokens + i - 1].")
      .def_prop_ro("path", &Model::path)
      .def_prop_ro("device", &Model::device)
      .def_prop_ro("threads", &Model::threads)
      .def_prop_ro("architecture", [](const Model& m) { return m.config().architecture; })
      .def_prop_ro("n_layers", [](const Model& m) { return m.config().n_layers; })
      .def_prop_ro("n_q_heads", [](const Model& m) { return m.config().n_heads; })
      .def_prop_ro("n_kv_heads", [](const Model& m) { return m.config().n_kv_heads; })
      .def_prop_ro("head_dim", [](const Model& m) { return m.config().head_dim; })
      .def_prop_ro("vocab_size", [](const Model& m) { return m.config().vocab_size; })
      .def_prop_ro("context_length", [](const Model& m) { return m.config().context_length; })
      .def_prop_ro("bos_id", [](const Model& m) { return m.tokenizer().bos_id(); }, "-1 when there is none")
      .def_prop_ro("eos_id", [](const Model& m) { return m.tokenizer().eos_id(); }, "-1 when there is none")
      .def_prop_ro("add_bos", [](const Model& m) { return m.tokenizer().add_bos_default(); },
                   "whether tokenize and generate prepend BOS by default")
      .def("__repr__", [](const Model& m) {
        return fmt::format("Model('{}', device='{}', threads={}: {} layers, {} query / {} kv heads of {})", m.path(),
                           m.device(), m.threads(), m.config().n_layers, m.config().n_heads, m.config().n_kv_heads,
                           m.config().head_dim);
      });
}

}  // namespace cumulus::python
