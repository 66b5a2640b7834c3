// The prefill:decode controller on tables (no actors): each row feeds one
// interval's samples and expects the move; hysteresis, cooldown and the
// one-stage floor follow from the rules in actors/pd_controller.h.
#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "actors/pd_controller.h"

using namespace cleave;

namespace {

struct Interval {
  std::vector<double> ttft_ms, tpot_ms;
  int32_t prefills, decoders;
  RoleMove want;
};

void run(PdController& c, const std::vector<Interval>& rows, double t0 = 0) {
  double t = t0;
  int row = 0;
  for (const Interval& r : rows) {
    CAPTURE(row);
    for (double v : r.ttft_ms) c.observe_ttft(v / 1e3);
    for (double v : r.tpot_ms) c.observe_tpot(v / 1e3);
    t += c.config().interval_s;
    const RoleMove m = c.decide(t, r.prefills, r.decoders);
    CHECK(m == r.want);
    if (m != RoleMove::none) c.moved(t);
    ++row;
  }
}

PdControllerConfig goals(double ttft_ms, double tpot_ms, int32_t confirm = 2, double cooldown_s = 3) {
  PdControllerConfig c;
  c.ttft_ms = ttft_ms;
  c.tpot_ms = tpot_ms;
  c.interval_s = 1;
  c.confirm = confirm;
  c.cooldown_s = cooldown_s;
  return c;
}

}  // namespace

TEST_CASE("pd controller: TTFT over its goal moves a decoder to prefill once confirmed") {
  PdController c(goals(100, 20));
  const auto none = RoleMove::none, to_p = RoleMove::to_prefill;
  run(c, {
             {{300, 300}, {10}, 1, 3, none},  // TTFT 3x its goal, TPOT half: first interval of the streak
             {{250}, {12}, 1, 3, to_p},       // confirmed: move
             {{300}, {10}, 2, 2, none},       // cooldown (3 s) and a new streak
             {{300}, {10}, 2, 2, none},
             {{300}, {10}, 2, 2, to_p},       // 3 s after the move, streak 3 >= 2
             {{300}, {10}, 3, 1, none},       // one decoder left: never below one
         });
  CHECK(c.ttft_pressure() == doctest::Approx(3.0));
}

TEST_CASE("pd controller: TPOT over its goal moves a prefill to decode, a changing verdict restarts the streak") {
  PdController c(goals(100, 20, 3, 0));
  const auto none = RoleMove::none, to_d = RoleMove::to_decode;
  run(c, {
             {{50}, {40}, 2, 1, none},
             {{50}, {40}, 2, 1, none},
             {{300}, {10}, 2, 1, none},  // the other way for one interval (and one decoder: no move)
             {{50}, {40}, 2, 1, none},   // streak starts again
             {{50}, {40}, 2, 1, none},
             {{50}, {40}, 2, 1, to_d},
             {{50}, {40}, 1, 2, none},  // one prefill left
         });
}

TEST_CASE("pd controller: both over their goals within the margin, or no samples, is no move") {
  PdController c(goals(100, 20, 1, 0));
  const auto none = RoleMove::none;
  run(c, {
             {{200}, {36}, 2, 2, none},  // 2.0 vs 1.8: within 25 %
             {{}, {}, 2, 2, none},        // no samples: on target
             {{90}, {19}, 2, 2, none},    // both under their goals
             {{300}, {}, 2, 2, RoleMove::to_prefill},  // no TPOT samples: TTFT alone decides
         });
  // TTFT only: TPOT pressure is 0.
  PdController t(goals(100, 0, 1, 0));
  run(t, {{{50}, {999}, 2, 2, none}, {{150}, {999}, 2, 2, RoleMove::to_prefill}});
}

TEST_CASE("pd controller: configuration refused by name") {
  struct Bad {
    PdControllerConfig c;
    const char* message;
  };
  auto with = [](auto f) {
    PdControllerConfig c = goals(100, 20);
    f(c);
    return c;
  };
  CHECK(validate_pd_controller(goals(100, 20)).ok());
  for (const Bad& b : {Bad{with([](auto& c) { c.ttft_ms = c.tpot_ms = 0; }), "needs a goal"},
                       Bad{with([](auto& c) { c.ttft_ms = -1; }), "ttft_ms"},
                       Bad{with([](auto& c) { c.interval_s = 0; }), "interval_s"},
                       Bad{with([](auto& c) { c.confirm = 0; }), "confirm"},
                       Bad{with([](auto& c) { c.cooldown_s = -1; }), "cooldown_s"},
                       Bad{with([](auto& c) { c.margin = 11; }), "margin"}}) {
    Status st = validate_pd_controller(b.c);
    CHECK(st.code() == Code::invalid_argument);
    CHECK_MESSAGE(st.message().find(b.message) != std::string::npos, st.message());
  }
}

// Under a prompt-heavy load TPOT can cross its goal now and then while the
// prefill stages are busy: moving one of them to decode would leave the
// rest over capacity. The busy fraction arrivals saw decides.
TEST_CASE("pd controller: a prefill stage goes to decode only when the others keep room") {
  const auto none = RoleMove::none, to_d = RoleMove::to_decode;
  auto row = [](PdController& c, double busy, int n_busy, int32_t prefills) {
    for (int i = 0; i < n_busy; ++i) c.observe_prefill_busy(busy);
    c.observe_ttft(0.050);  // TTFT half its goal
    c.observe_tpot(0.040);  // TPOT twice its goal
    return c.decide(0, prefills, 1);
  };
  {
    PdController c(goals(100, 20, 1, 0));
    CHECK(row(c, 0.8, 5, 2) == none);  // 0.8 x 2 / 1 = 1.6: no room
    CHECK(c.prefill_busy() == doctest::Approx(0.8));
    CHECK(row(c, 0.5, 5, 2) == none);  // 1.0 > 0.9
    CHECK(row(c, 0.45, 5, 2) == to_d);  // 0.9: room
  }
  {
    PdController c(goals(100, 20, 1, 0));
    CHECK(row(c, 0.6, 4, 3) == to_d);  // 0.6 x 3 / 2 = 0.9
    CHECK(row(c, 0.7, 4, 3) == none);  // 1.05
  }
  {
    PdController c(goals(100, 20, 1, 0));
    CHECK(row(c, 0.0, 0, 2) == to_d);  // no arrivals: nothing says the prefill side is busy
    CHECK(c.prefill_busy() == -1);
    CHECK(row(c, 0.1, 3, 1) == none);  // never below one prefill stage
  }
  {
    // Out-of-range samples are ignored; a streak of confirmations resets
    // when the room goes.
    PdController c(goals(100, 20, 2, 0));
    c.observe_prefill_busy(-0.5);
    c.observe_prefill_busy(2.0);
    CHECK(row(c, 0.2, 1, 2) == none);  // first of the streak (mean 0.2, the bad samples dropped)
    CHECK(c.prefill_busy() == doctest::Approx(0.2));
    CHECK(row(c, 0.9, 2, 2) == none);  // no room: the streak ends
    CHECK(row(c, 0.2, 2, 2) == none);  // a new streak
    CHECK(row(c, 0.2, 2, 2) == to_d);
  }
}

// A backlog of prompts shows in TTFT only as it drains; the requests still
// waiting past the goal count at once.
TEST_CASE("pd controller: requests waiting past the TTFT goal count as TTFT samples") {
  PdController c(goals(100, 20, 1, 0));
  // No first token yet anywhere: ages under the goal say nothing.
  c.observe_waiting(0.050);
  c.observe_waiting(0.099);
  CHECK(c.decide(1, 1, 2) == RoleMove::none);
  CHECK(c.ttft_pressure() == 0);
  // Two finished at 60 ms and two still waiting at 250 and 350 ms: mean 180 ms.
  c.observe_ttft(0.060);
  c.observe_ttft(0.060);
  c.observe_waiting(0.250);
  c.observe_waiting(0.350);
  c.observe_waiting(0.020);
  CHECK(c.decide(2, 1, 2) == RoleMove::to_prefill);
  CHECK(c.ttft_pressure() == doctest::Approx(1.8));
  // Without a TTFT goal nothing waits "past" it.
  PdController t(goals(0, 20, 1, 0));
  t.observe_waiting(100);
  CHECK(t.decide(1, 1, 2) == RoleMove::none);
  CHECK(t.ttft_pressure() == 0);
}

// A hand-off waiting for a decode row shows in TPOT only once it gets its
// next token; the requests stalled past the goal count at once.
TEST_CASE("pd controller: requests stalled past the TPOT goal count as TPOT samples") {
  PdController c(goals(100, 20, 1, 0));
  // Stalls under the goal say nothing.
  c.observe_stalled(0.005);
  c.observe_stalled(0.0199);
  CHECK(c.decide(1, 2, 1) == RoleMove::none);
  CHECK(c.tpot_pressure() == 0);
  // Two gaps of 10 ms and two requests stalled for 60 and 80 ms: mean 40 ms.
  c.observe_tpot(0.010);
  c.observe_tpot(0.010);
  c.observe_stalled(0.060);
  c.observe_stalled(0.080);
  c.observe_stalled(0.002);
  CHECK(c.decide(2, 2, 1) == RoleMove::to_decode);
  CHECK(c.tpot_pressure() == doctest::Approx(2.0));
  // Without a TPOT goal nothing stalls "past" it.
  PdController t(goals(100, 0, 1, 0));
  t.observe_stalled(100);
  CHECK(t.decide(1, 2, 1) == RoleMove::none);
  CHECK(t.tpot_pressure() == 0);
}

// A shift to longer prompts shows in the arrivals before any request waits:
// the prompt tokens that arrived per second over what the prefill side
// measured it prefills.
TEST_CASE("pd controller: an overloaded prefill side moves a decoder at once, a loaded one keeps its stages") {
  const auto none = RoleMove::none, to_p = RoleMove::to_prefill, to_d = RoleMove::to_decode;
  // One interval (1 s): `tokens` arrived, the side prefills `capacity` a second.
  auto row = [](PdController& c, double t, int64_t tokens, double capacity, int32_t prefills, int32_t decoders,
                double tpot_ms = 10) {
    for (int64_t left = tokens; left > 0; left -= 480) c.observe_arrival(std::min<int64_t>(left, 480));
    c.observe_tpot(tpot_ms / 1e3);
    c.observe_prefill_capacity(capacity);
    return c.decide(t, prefills, decoders);
  };
  {
    // confirm 2: a load of 1.5 (no request has waited yet) moves in its first interval.
    PdController c(goals(100, 20, 2, 3));
    CHECK(row(c, 1, 12000, 8000, 1, 2) == to_p);
    CHECK(c.prefill_load() == doctest::Approx(1.5));
    c.moved(1);
    CHECK(row(c, 2, 12000, 8000, 2, 1) == none);  // one decoder left
  }
  {
    // Overload is not held by the cooldown: a move to decode at 1 s (cooldown
    // 3 s), then the prompts arrive at 1.5x what the side prefills at 2 s.
    PdController c(goals(100, 20, 2, 3));
    c.moved(1);
    CHECK(row(c, 2, 12000, 8000, 1, 2) == to_p);
    c.moved(2);
    // Under the overload the cooldown holds: a load of 1.2, confirmed, waits.
    CHECK(row(c, 3, 9600, 8000, 1, 2) == none);
    CHECK(row(c, 4, 9600, 8000, 1, 2) == none);
    CHECK(row(c, 5, 9600, 8000, 1, 2) == to_p);  // 3 s after the move
  }
  {
    // Over 1 but under kPrefillOverload: TTFT pressure that needs its confirming interval.
    PdController c(goals(100, 20, 2, 0));
    CHECK(row(c, 1, 9600, 8000, 1, 2) == none);  // load 1.2: first of the streak
    CHECK(row(c, 2, 9600, 8000, 1, 2) == to_p);  // confirmed
  }
  {
    // At most 1 is not pressure; unmeasured capacity (0) computes no load.
    PdController c(goals(100, 20, 1, 0));
    CHECK(row(c, 1, 8000, 8000, 1, 2) == none);
    CHECK(row(c, 2, 1e6, 0, 1, 2) == none);
    CHECK(c.prefill_load() == -1);
    CHECK(c.ttft_pressure() == 0);
  }
  {
    // The interval is the time since the last decision: 12000 tokens over 2 s at 8000/s is 0.75.
    PdController c(goals(100, 20, 1, 0));
    CHECK(row(c, 1, 0, 8000, 1, 2) == none);
    CHECK(row(c, 3, 12000, 8000, 1, 2) == none);
    CHECK(c.prefill_load() == doctest::Approx(0.75));
  }
  {
    // Room: TPOT twice its goal, idle arrivals by the busy fraction, but a
    // load of 0.6 on two prefill stages would be 1.2 on one.
    PdController c(goals(100, 20, 1, 0));
    c.observe_prefill_busy(0.1);
    CHECK(row(c, 1, 9600, 16000, 2, 1, 40) == none);
    c.observe_prefill_busy(0.1);
    CHECK(row(c, 2, 7200, 16000, 2, 1, 40) == to_d);  // 0.45 x 2 = 0.9: room
  }
  {
    // TPOT further over its goal than the load is over 1 (by the margin): decode wins.
    PdController c(goals(100, 20, 1, 0));
    CHECK(row(c, 1, 9600, 8000, 2, 2, 60) == none);  // load 1.2, TPOT 3x; no room to give a prefill
  }
}
