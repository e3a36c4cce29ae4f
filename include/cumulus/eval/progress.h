// A progress bar with an estimate of the time left, for long evaluation runs. Work comes
// in two kinds whose costs differ: prefill tokens and decode steps. Each kind's seconds per
// unit is measured as the run goes (a decode step is first assumed to cost
// kDecodeStepGuess prefill tokens), and the time left is the work left at those rates.
// It draws on one line of `out` with '\r' and only when `out` is a terminal (isatty), so
// redirected logs stay clean; `cumulus eval` passes stderr.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace cumulus {

class Progress {
 public:
  static constexpr double kDecodeStepGuess = 4.0;

  // out == nullptr or not a terminal: silent. `force` draws even when out is not a terminal
  // (tests).
  explicit Progress(std::FILE* out, bool force = false);
  ~Progress();  // ends the line when something was drawn

  // Adds planned work (called as a task learns its size; may grow during the run).
  void plan(int64_t prefill_tokens, int64_t decode_steps);
  // Reports finished work and what is running now.
  void prefilled(int64_t tokens);
  void decoded(int64_t steps);
  void label(const std::string& text);

  // Seconds left at the measured rates (0 when nothing is planned).
  double seconds_left() const;
  // The current line, without '\r' (what draw() prints).
  std::string line() const;

 private:
  using Clock = std::chrono::steady_clock;
  void draw();
  // Time since the last mark goes to `seconds`, `units` to `done`.
  void charge(double& seconds, int64_t& done, int64_t units);

  std::FILE* out_ = nullptr;
  bool enabled_ = false, drawn_ = false;
  Clock::time_point start_, last_draw_;
  int64_t prefill_total_ = 0, prefill_done_ = 0, decode_total_ = 0, decode_done_ = 0;
  double prefill_s_ = 0, decode_s_ = 0;  // seconds spent on each kind so far
  Clock::time_point mark_;               // end of the last reported unit of work
  std::string label_;
};

// "1h02m", "3m05s", "42s".
std::string duration_text(double seconds);

}  // namespace cumulus
