// Progress bar with a time-left estimate (progress.h).
#include "cumulus/eval/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

namespace cumulus {

std::string duration_text(double seconds) {
  const int64_t s = static_cast<int64_t>(std::llround(std::max(seconds, 0.0)));
  if (s >= 3600) return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
  if (s >= 60) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

Progress::Progress(std::FILE* out, bool force) : out_(out) {
  enabled_ = out != nullptr && (force || isatty(fileno(out)) == 1);
  start_ = last_draw_ = mark_ = Clock::now();
}

Progress::~Progress() {
  if (drawn_) {
    // Planned work that did not happen (budget matching that converged early) is done too.
    prefill_done_ = std::max(prefill_done_, prefill_total_);
    decode_done_ = std::max(decode_done_, decode_total_);
    last_draw_ = Clock::time_point{};
    draw();
    std::fputc('\n', out_);
    std::fflush(out_);
  }
}

void Progress::plan(int64_t prefill_tokens, int64_t decode_steps) {
  prefill_total_ += prefill_tokens;
  decode_total_ += decode_steps;
}

void Progress::charge(double& seconds, int64_t& done, int64_t units) {
  const Clock::time_point now = Clock::now();
  seconds += std::chrono::duration<double>(now - mark_).count();
  mark_ = now;
  done += units;
  draw();
}

void Progress::prefilled(int64_t tokens) { charge(prefill_s_, prefill_done_, tokens); }
void Progress::decoded(int64_t steps) { charge(decode_s_, decode_done_, steps); }

void Progress::label(const std::string& text) {
  label_ = text;
  mark_ = Clock::now();  // time between units (setup, reports) is charged to neither kind
  draw();
}

double Progress::seconds_left() const {
  const int64_t pf_left = std::max<int64_t>(prefill_total_ - prefill_done_, 0);
  const int64_t dec_left = std::max<int64_t>(decode_total_ - decode_done_, 0);
  // Rates measured so far; a kind not yet seen borrows the other's rate.
  double pf_rate = prefill_done_ > 0 ? prefill_s_ / prefill_done_ : 0;
  double dec_rate = decode_done_ > 0 ? decode_s_ / decode_done_ : 0;
  if (pf_rate == 0 && dec_rate > 0) pf_rate = dec_rate / kDecodeStepGuess;
  if (dec_rate == 0 && pf_rate > 0) dec_rate = pf_rate * kDecodeStepGuess;
  return pf_left * pf_rate + dec_left * dec_rate;
}

std::string Progress::line() const {
  const double total = prefill_total_ + kDecodeStepGuess * decode_total_;
  const double done = std::min<double>(prefill_done_, prefill_total_) +
                      kDecodeStepGuess * std::min<double>(decode_done_, decode_total_);
  const double frac = total > 0 ? std::clamp(done / total, 0.0, 1.0) : 0.0;
  constexpr int kWidth = 24;
  const int filled = static_cast<int>(frac * kWidth);
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  const bool known = prefill_done_ + decode_done_ > 0;
  return fmt::format("[{}{}] {:3.0f}% {} elapsed, {} left  {}", std::string(filled, '#'),
                     std::string(kWidth - filled, '.'), 100 * frac, duration_text(elapsed),
                     known ? duration_text(seconds_left()) : std::string("?"), label_);
}

void Progress::draw() {
  if (!enabled_) return;
  const Clock::time_point now = Clock::now();
  // At most ~5 redraws a second: a decode step on stories260K takes microseconds.
  if (drawn_ && now - last_draw_ < std::chrono::milliseconds(200)) return;
  last_draw_ = now;
  std::string l = line();
  constexpr size_t kMaxColumns = 110;
  if (l.size() > kMaxColumns) l.resize(kMaxColumns);
  fmt::print(out_, "\r{:<{}}", l, kMaxColumns);
  std::fflush(out_);
  drawn_ = true;
}

}  // namespace cumulus
