// Reference tool, built against llama.cpp by tools/reference/build_llamacpp.sh (never part
// of the cumulus build): feeds given token ids to a GGUF model in one batch, causally from
// position 0, and prints the top-k logits (id, value) at chosen positions as JSON.
// tools/reference/make_llamacpp_logits_fixture.py drives it to write the golden fixture
// tests/data/smollm2_llamacpp_logits.json (and make_gemma3_llamacpp_fixture.py the Gemma 3
// one).
//
// Usage: llamacpp_logits MODEL TOKENS_FILE POSITIONS TOP_K THREADS [GREEDY]
//   TOKENS_FILE: whitespace-separated token ids; POSITIONS: comma-separated indices into them.
//   GREEDY > 0: then decodes GREEDY tokens greedily (argmax, one token per llama_decode) after
//   the last token and prints {"logits": [...], "greedy": [ids], "greedy_margin": [top-1 logit
//   minus top-2 logit at each greedy step]} instead of the bare array.
//        llamacpp_logits --tokenize MODEL TEXT_FILE
//   prints llama.cpp's token ids of the file's text (special tokens as the model's
//   add_bos_token says, no parsing of special-token text) as a JSON array.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

namespace {

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "llamacpp_logits: %s\n", what.c_str());
  std::exit(1);
}

}  // namespace

int tokenize_main(const std::string& model_path, const std::string& text_path) {
  std::ifstream in(text_path, std::ios::binary);
  if (!in) die("cannot open " + text_path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  mp.vocab_only = true;
  llama_model* model = llama_model_load_from_file(model_path.c_str(), mp);
  if (!model) die("cannot load " + model_path);
  const llama_vocab* vocab = llama_model_get_vocab(model);
  std::vector<llama_token> ids(text.size() + 16);
  const int n = llama_tokenize(vocab, text.data(), static_cast<int32_t>(text.size()), ids.data(),
                               static_cast<int32_t>(ids.size()), /*add_special=*/true, /*parse_special=*/false);
  if (n < 0) die("llama_tokenize failed");
  std::printf("[");
  for (int i = 0; i < n; ++i) std::printf("%s%d", i ? "," : "", ids[static_cast<size_t>(i)]);
  std::printf("]\n");
  llama_model_free(model);
  llama_backend_free();
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--tokenize") return tokenize_main(argv[2], argv[3]);
  if (argc != 6 && argc != 7) die("usage: llamacpp_logits MODEL TOKENS_FILE POSITIONS TOP_K THREADS [GREEDY]");
  const std::string model_path = argv[1];
  std::vector<llama_token> tokens;
  {
    std::ifstream in(argv[2]);
    if (!in) die(std::string("cannot open ") + argv[2]);
    long v;
    while (in >> v) tokens.push_back(static_cast<llama_token>(v));
  }
  std::vector<int> positions;
  {
    std::stringstream ss(argv[3]);
    std::string item;
    while (std::getline(ss, item, ',')) positions.push_back(std::atoi(item.c_str()));
  }
  const int top_k = std::atoi(argv[4]), threads = std::atoi(argv[5]);
  const int greedy = argc == 7 ? std::atoi(argv[6]) : 0;
  if (greedy < 0) die("GREEDY must be >= 0");
  const int n = static_cast<int>(tokens.size());
  if (n == 0) die("no tokens");
  for (int p : positions)
    if (p < 0 || p >= n) die("position " + std::to_string(p) + " outside the " + std::to_string(n) + " tokens");

  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(model_path.c_str(), mp);
  if (!model) die("cannot load " + model_path);
  const llama_vocab* vocab = llama_model_get_vocab(model);
  const int n_vocab = llama_vocab_n_tokens(vocab);
  for (llama_token t : tokens)
    if (t < 0 || t >= n_vocab) die("token id " + std::to_string(t) + " outside the vocabulary");

  // One batch, one micro-batch: every position sees exactly the causal prefix.
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(n + greedy);
  cp.n_batch = static_cast<uint32_t>(n);
  cp.n_ubatch = static_cast<uint32_t>(n);
  // LLAMACPP_FLASH_ATTN=0 / 1 forces llama.cpp's attention path off / on (default: its
  // auto choice), to measure how far its two paths differ from each other.
  if (const char* fa = std::getenv("LLAMACPP_FLASH_ATTN"); fa != nullptr)
    cp.flash_attn_type = std::string(fa) == "0" ? LLAMA_FLASH_ATTN_TYPE_DISABLED : LLAMA_FLASH_ATTN_TYPE_ENABLED;
  cp.n_threads = threads;
  cp.n_threads_batch = threads;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) die("cannot create a context");

  llama_batch batch = llama_batch_init(n, 0, 1);
  for (int i = 0; i < n; ++i) {
    batch.token[i] = tokens[i];
    batch.pos[i] = i;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = std::find(positions.begin(), positions.end(), i) != positions.end();
  }
  batch.n_tokens = n;
  if (llama_decode(ctx, batch) != 0) die("llama_decode failed");

  if (greedy > 0) std::printf("{\"logits\": ");
  std::printf("[\n");
  for (size_t k = 0; k < positions.size(); ++k) {
    const float* logits = llama_get_logits_ith(ctx, positions[k]);
    if (!logits) die("no logits at position " + std::to_string(positions[k]));
    std::vector<int> idx(static_cast<size_t>(n_vocab));
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + top_k, idx.end(),
                      [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
    std::printf("  {\"position\": %d, \"top\": [", positions[k]);
    for (int j = 0; j < top_k; ++j) std::printf("%s[%d, %.9g]", j ? ", " : "", idx[j], logits[idx[j]]);
    std::printf("]}%s\n", k + 1 < positions.size() ? "," : "");
  }
  std::printf("]");
  if (greedy > 0) {
    // Greedy continuation: argmax of the last logits (lowest id on ties), fed back one at a time.
    std::printf(",\n\"greedy\": [");
    const float* logits = llama_get_logits_ith(ctx, n - 1);
    llama_batch one = llama_batch_init(1, 0, 1);
    std::vector<double> margins;
    for (int g = 0; g < greedy; ++g) {
      int best = 0;
      for (int v = 1; v < n_vocab; ++v)
        if (logits[v] > logits[best]) best = v;
      float second = -INFINITY;
      for (int v = 0; v < n_vocab; ++v)
        if (v != best) second = std::max(second, logits[v]);
      margins.push_back(static_cast<double>(logits[best]) - second);
      std::printf("%s%d", g ? ", " : "", best);
      one.token[0] = best;
      one.pos[0] = n + g;
      one.n_seq_id[0] = 1;
      one.seq_id[0][0] = 0;
      one.logits[0] = 1;
      one.n_tokens = 1;
      if (llama_decode(ctx, one) != 0) die("llama_decode failed (greedy)");
      logits = llama_get_logits_ith(ctx, 0);
      if (!logits) die("no logits (greedy)");
    }
    std::printf("],\n\"greedy_margin\": [");
    for (size_t g = 0; g < margins.size(); ++g) std::printf("%s%.9g", g ? ", " : "", margins[g]);
    std::printf("]}");
    llama_batch_free(one);
  }
  std::printf("\n");
  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
