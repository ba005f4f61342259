"""Problem templates: each draws names and numbers, then writes the question and the
step-by-step answer in GSM8K's style (``48/2 = <<48/2=24>>24`` calculator annotations).

Learnability is designed in: every operation goes through ``calc``, which rejects a draw whose
result is negative, not an integer or >= 1000, any product that is not (2-digit number) x
(number up to 12), and any quotient whose divisor exceeds 12 or whose result exceeds 99.  So a
~10M-parameter model only ever has to learn sums and differences below 1000 and the times
tables of 1..12 against 1..99, over 2-4 steps.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from blockspec.gsm8k_data.vocab import (ANIMALS, CONTAINERS, DAYS, GOODS, GROUPS, ITEMS, PEOPLE,
                                       PLACES)

MAX_RESULT = 999
MAX_SMALL_FACTOR = 12
MAX_LARGE_FACTOR = 99


class Reject(Exception):
    """The numbers drawn break a learnability rule; the template draws again."""


def calc(a: int, sym: str, b: int) -> int:
    """a <sym> b under the learnability rules (see module docstring)."""
    if sym == "+":
        c = a + b
    elif sym == "-":
        c = a - b
    elif sym == "*":
        if min(a, b) > MAX_SMALL_FACTOR or max(a, b) > MAX_LARGE_FACTOR:
            raise Reject
        c = a * b
    elif sym == "/":
        if b == 0 or b > MAX_SMALL_FACTOR or a % b or a // b > MAX_LARGE_FACTOR:
            raise Reject
        c = a // b
    else:
        raise ValueError(f"unknown operation {sym!r}")
    if not 0 <= c <= MAX_RESULT:
        raise Reject
    return c


@dataclass
class Person:
    name: str
    he: str      # subject pronoun
    his: str     # possessive pronoun

    @property
    def He(self) -> str:
        return self.he.capitalize()

    @property
    def His(self) -> str:
        return self.his.capitalize()


class Draw:
    """Seeded choices plus the answer being written (one per problem)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.lines: list[str] = []
        self._used: set[str] = set()

    def n(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def pick(self, seq):
        return self.rng.choice(seq)

    def person(self) -> Person:
        while True:
            p = Person(*self.rng.choice(PEOPLE))
            if p.name not in self._used:
                self._used.add(p.name)
                return p

    def item(self) -> tuple[str, str]:
        return self.rng.choice(ITEMS)

    def op(self, a: int, sym: str, b: int, money: bool = False) -> tuple[int, str]:
        """(result, ``a*b = <<a*b=c>>c``) with an optional ``$`` before the annotation."""
        c = calc(a, sym, b)
        d = "$" if money else ""
        return c, f"{a}{sym}{b} = {d}<<{a}{sym}{b}={c}>>{c}"

    def sum3(self, a: int, b: int, c: int, money: bool = False) -> tuple[int, str]:
        s = calc(calc(a, "+", b), "+", c)
        d = "$" if money else ""
        return s, f"{a}+{b}+{c} = {d}<<{a}+{b}+{c}={s}>>{s}"

    def say(self, *variants: str) -> None:
        self.lines.append(self.rng.choice(variants))


Template = Callable[[Draw], tuple[str, int]]


# --- the templates: each returns (question, final answer) and writes d.lines ---------------

def packs_plus_owned(d: Draw) -> tuple[str, int]:
    p, (c1, cs) = d.person(), d.pick(CONTAINERS)
    _, items = d.item()
    k, per, had = d.n(2, 9), d.n(3, 24), d.n(2, 60)
    q = d.pick((f"{p.name} buys {k} {cs} of {items}. Each {c1} has {per} {items}. "
                f"{p.He} already had {had} {items}. How many {items} does {p.he} have now?",
                f"{p.name} has {had} {items}. {p.He} gets {k} more {cs} with {per} {items} in "
                f"each {c1}. How many {items} does {p.name} have in all?"))
    got, e = d.op(k, "*", per)
    d.say(f"{p.name} gets {e} {items} from the {cs}.", f"The {cs} hold {e} {items}.")
    total, e = d.op(had, "+", got)
    d.say(f"{p.He} has {e} {items} now.", f"So {p.name} has {e} {items} in all.")
    return q, total


def times_as_many(d: Draw) -> tuple[str, int]:
    p, (_, items) = d.person(), d.item()
    day1, day2 = d.rng.sample(DAYS, 2)
    a, k = d.n(3, 99), d.n(2, 6)
    verb, base = d.pick((("sold", "sell"), ("made", "make"), ("collected", "collect"),
                         ("picked", "pick"), ("found", "find")))
    q = (f"{p.name} {verb} {a} {items} on {day1}. On {day2}, {p.he} {verb} {k} times as many "
         f"{items}. How many {items} did {p.name} {base} in total?")
    b, e = d.op(a, "*", k)
    d.say(f"On {day2}, {p.name} {verb} {e} {items}.", f"{p.He} {verb} {e} {items} on {day2}.")
    t, e = d.op(a, "+", b)
    d.say(f"In total {p.he} {verb} {e} {items}.", f"Altogether {p.name} {verb} {e} {items}.")
    return q, t


def half_as_many(d: Draw) -> tuple[str, int]:
    p, (_, items) = d.person(), d.item()
    m1, m2 = d.pick((("April", "May"), ("June", "July"), ("March", "April"),
                     ("September", "October")))
    a = 2 * d.n(4, 99)
    q = d.pick((f"{p.name} sold {items} to {a} of {p.his} {d.pick(GROUPS)} in {m1}, and then "
                f"{p.he} sold half as many {items} in {m2}. How many {items} did {p.name} sell "
                f"altogether in {m1} and {m2}?",
                f"In {m1}, {p.name} sold {a} {items}. In {m2}, {p.he} sold half as many. How "
                f"many {items} did {p.he} sell in both months?"))
    b, e = d.op(a, "/", 2)
    d.say(f"{p.name} sold {e} {items} in {m2}.")
    t, e = d.op(a, "+", b)
    d.say(f"{p.name} sold {e} {items} altogether in {m1} and {m2}.",
          f"So {p.he} sold {e} {items} in both months.")
    return q, t


def hourly_pay(d: Draw) -> tuple[str, int]:
    p = d.person()
    day1, day2 = d.rng.sample(DAYS, 2)
    w, h1, h2 = d.n(5, 45), d.n(1, 7), d.n(1, 5)
    job = d.pick(("babysitting", "tutoring", "walking dogs", "washing cars", "at the bakery",
                  "at the library", "mowing lawns"))
    q = (f"{p.name} earns ${w} an hour {job}. {p.He} works {h1} hours on {day1} and {h2} hours "
         f"on {day2}. How much money does {p.he} earn?")
    t, e = d.op(h1, "+", h2)
    d.say(f"{p.name} works {e} hours in all.", f"{p.He} works {e} hours.")
    m, e = d.op(t, "*", w, money=True)
    d.say(f"{p.He} earns {e}.", f"So {p.name} earns {e}.")
    return q, m


def change_left(d: Draw) -> tuple[str, int]:
    p, (g1, gs) = d.person(), d.pick(GOODS)
    k, price = d.n(2, 9), d.n(2, 40)
    cost = calc(k, "*", price)
    money = cost + d.n(1, 200)
    q = d.pick((f"{p.name} has ${money}. {p.He} buys {k} {gs} that cost ${price} each. How much "
                f"money does {p.he} have left?",
                f"{p.name} goes to the {d.pick(PLACES)} with ${money}. Each {g1} costs ${price}, "
                f"and {p.he} buys {k} of them. How many dollars does {p.he} have left?"))
    c, e = d.op(k, "*", price, money=True)
    d.say(f"The {gs} cost {e}.", f"{p.name} spends {e} on {gs}.")
    r, e = d.op(money, "-", c, money=True)
    d.say(f"{p.He} has {e} left.", f"So {p.name} has {e} left.")
    return q, r


def share_equally(d: Draw) -> tuple[str, int]:
    p, (_, items), grp = d.person(), d.item(), d.pick(GROUPS)
    k = d.n(2, 9)
    each = d.n(2, 40)
    total = calc(k, "*", each)
    a = d.n(1, total - 1)
    b = total - a
    q = (f"{p.name} has {a} {items}. {p.His} mom gives {p.his} {b} more. {p.He} shares all the "
         f"{items} equally among {k} {grp}. How many {items} does each of them get?")
    t, e = d.op(a, "+", b)
    d.say(f"{p.name} has {e} {items}.", f"Now {p.he} has {e} {items}.")
    r, e = d.op(t, "/", k)
    d.say(f"Each of the {grp} gets {e} {items}.", f"So each one gets {e} {items}.")
    return q, r


def garden_rows(d: Draw) -> tuple[str, int]:
    p = d.person()
    plant = d.pick(("tomato plants", "sunflowers", "carrots", "rose bushes", "pepper plants",
                    "tulips", "bean plants"))
    r, per = d.n(2, 12), d.n(3, 40)
    total = calc(r, "*", per)
    bad = d.n(1, total - 1)
    q = (f"{p.name} plants {r} rows of {plant} with {per} in each row. {bad} of them do not "
         f"grow. How many {plant} grow?")
    t, e = d.op(r, "*", per)
    d.say(f"{p.name} plants {e} {plant}.", f"There are {e} {plant} in the garden.")
    g, e = d.op(t, "-", bad)
    d.say(f"{e} {plant} grow.", f"So {e} of them grow.")
    return q, g


def pages_left(d: Draw) -> tuple[str, int]:
    p = d.person()
    a, days = d.n(5, 60), d.n(2, 12)
    read = calc(a, "*", days)
    total = read + d.n(1, 300)
    q = d.pick((f"A book has {total} pages. {p.name} reads {a} pages a day for {days} days. "
                f"How many pages are left to read?",
                f"{p.name} is reading a {total} page book. {p.He} reads {a} pages every day. How "
                f"many pages does {p.he} still have to read after {days} days?"))
    r, e = d.op(a, "*", days)
    d.say(f"{p.name} reads {e} pages.", f"In {days} days {p.he} reads {e} pages.")
    left, e = d.op(total, "-", r)
    d.say(f"There are {e} pages left.", f"So {p.he} has {e} pages left to read.")
    return q, left


def weekly_savings(d: Draw) -> tuple[str, int]:
    p, (g1, _) = d.person(), d.pick(GOODS)
    s, w = d.n(3, 60), d.n(2, 12)
    saved = calc(s, "*", w)
    spend = d.n(1, saved)
    q = (f"{p.name} saves ${s} every week for {w} weeks. Then {p.he} spends ${spend} on a "
         f"{g1}. How much money does {p.he} have left?")
    t, e = d.op(s, "*", w, money=True)
    d.say(f"{p.name} saves {e}.", f"After {w} weeks {p.he} has {e}.")
    r, e = d.op(t, "-", spend, money=True)
    d.say(f"{p.He} has {e} left.", f"So {p.name} has {e} left.")
    return q, r


def classroom(d: Draw) -> tuple[str, int]:
    c, s = d.n(2, 12), d.n(12, 35)
    total = calc(c, "*", s)
    gone = d.n(1, min(total - 1, 60))
    school = d.pick(("a school", "a summer camp", "a dance school", "a music school"))
    what = d.pick(("are absent", "go home early", "are on a trip", "stay home sick"))
    q = (f"There are {c} classes at {school} and each class has {s} students. {gone} students "
         f"{what}. How many students are still there?")
    t, e = d.op(c, "*", s)
    d.say(f"There are {e} students in all.", f"The classes have {e} students.")
    r, e = d.op(t, "-", gone)
    d.say(f"{e} students are still there.", f"So {e} students are still there.")
    return q, r


def two_purchases(d: Draw) -> tuple[str, int]:
    p = d.person()
    (_, g1s), (_, g2s) = d.rng.sample(GOODS, 2)
    a, pa, b, pb = d.n(2, 9), d.n(2, 40), d.n(2, 9), d.n(2, 40)
    q = (f"{p.name} buys {a} {g1s} for ${pa} each and {b} {g2s} for ${pb} each. How much does "
         f"{p.he} spend in total?")
    x, e = d.op(a, "*", pa, money=True)
    d.say(f"The {g1s} cost {e}.")
    y, e = d.op(b, "*", pb, money=True)
    d.say(f"The {g2s} cost {e}.")
    t, e = d.op(x, "+", y, money=True)
    d.say(f"{p.He} spends {e} in total.", f"In total {p.name} spends {e}.")
    return q, t


def baking(d: Draw) -> tuple[str, int]:
    p, o = d.person(), d.person()
    treat = d.pick(("cookies", "muffins", "cupcakes", "brownies", "rolls", "tarts"))
    t, per = d.n(2, 9), d.n(6, 30)
    total = calc(t, "*", per)
    eat = d.n(1, 9)
    give = d.n(1, max(1, total - eat - 1))
    q = (f"{p.name} bakes {t} trays of {treat} with {per} {treat} on each tray. {p.He} eats "
         f"{eat} of them and gives {give} to {o.name}. How many {treat} are left?")
    c, e = d.op(t, "*", per)
    d.say(f"{p.name} bakes {e} {treat}.")
    r1, e = d.op(c, "-", eat)
    d.say(f"After eating some, {p.he} has {e} {treat}.")
    r2, e = d.op(r1, "-", give)
    d.say(f"After giving some to {o.name}, {e} {treat} are left.")
    return q, r2


def road_trip(d: Draw) -> tuple[str, int]:
    p = d.person()
    s1, h1, s2, h2 = d.n(20, 70), d.n(1, 6), d.n(20, 70), d.n(1, 6)
    q = (f"{p.name} drives at {s1} miles per hour for {h1} hours and then at {s2} miles per "
         f"hour for {h2} hours. How many miles does {p.he} drive?")
    x, e = d.op(s1, "*", h1)
    d.say(f"First {p.he} drives {e} miles.")
    y, e = d.op(s2, "*", h2)
    d.say(f"Then {p.he} drives {e} miles.")
    t, e = d.op(x, "+", y)
    d.say(f"{p.name} drives {e} miles in all.")
    return q, t


def ages(d: Draw) -> tuple[str, int]:
    a, b, c = d.person(), d.person(), d.person()
    age, k, diff = d.n(2, 15), d.n(2, 5), d.n(1, 20)
    q = (f"{a.name} is {age} years old. {b.name} is {k} times as old as {a.name}. {c.name} is "
         f"{diff} years younger than {b.name}. How old is {c.name}?")
    x, e = d.op(age, "*", k)
    d.say(f"{b.name} is {e} years old.")
    y, e = d.op(x, "-", diff)
    d.say(f"{c.name} is {e} years old.")
    return q, y


def three_collectors(d: Draw) -> tuple[str, int]:
    a, b, c = d.person(), d.person(), d.person()
    _, items = d.item()
    x, more = d.n(3, 60), d.n(1, 35)
    q = (f"{a.name} has {x} {items}. {b.name} has {more} more {items} than {a.name}. {c.name} "
         f"has twice as many {items} as {b.name}. How many {items} do they have together?")
    y, e = d.op(x, "+", more)
    d.say(f"{b.name} has {e} {items}.")
    z, e = d.op(y, "*", 2)
    d.say(f"{c.name} has {e} {items}.")
    t, e = d.sum3(x, y, z)
    d.say(f"Together they have {e} {items}.")
    return q, t


def filled_containers(d: Draw) -> tuple[str, int]:
    p, (c1, cs), (_, items) = d.person(), d.pick(CONTAINERS), d.item()
    per, k, rest = d.n(3, 40), d.n(2, 12), d.n(1, 30)
    q = (f"{p.name} puts {items} into {cs}. Each {c1} holds {per} {items}. {p.He} fills {k} "
         f"{cs} and has {rest} {items} left over. How many {items} did {p.he} start with?")
    x, e = d.op(per, "*", k)
    d.say(f"The {cs} hold {e} {items}.", f"{p.name} packs {e} {items}.")
    t, e = d.op(x, "+", rest)
    d.say(f"{p.He} started with {e} {items}.")
    return q, t


def price_difference(d: Draw) -> tuple[str, int]:
    p = d.person()
    (g1, _), (g2, g2s) = d.rng.sample(GOODS, 2)
    a, more, k = d.n(2, 60), d.n(1, 30), d.n(2, 9)
    q = (f"A {g1} costs ${a}. A {g2} costs ${more} more than the {g1}. How much does {p.name} "
         f"pay for {k} {g2s}?")
    c, e = d.op(a, "+", more, money=True)
    d.say(f"One {g2} costs {e}.")
    t, e = d.op(c, "*", k, money=True)
    d.say(f"{p.name} pays {e} for {k} {g2s}.", f"So {k} {g2s} cost {e}.")
    return q, t


def farm_legs(d: Draw) -> tuple[str, int]:
    (a1, l1), (a2, l2) = d.rng.sample(ANIMALS, 2)
    x, y = d.n(2, 60), d.n(2, 60)
    who = d.pick(("A farm", "A zoo", "A barn", f"{d.person().name}'s farm"))
    q = f"{who} has {x} {a1} and {y} {a2}. How many legs do the animals have in all?"
    u, e = d.op(x, "*", l1)
    d.say(f"The {a1} have {e} legs.")
    v, e = d.op(y, "*", l2)
    d.say(f"The {a2} have {e} legs.")
    t, e = d.op(u, "+", v)
    d.say(f"The animals have {e} legs in all.", f"So there are {e} legs in all.")
    return q, t


def running_weeks(d: Draw) -> tuple[str, int]:
    p = d.person()
    sport = d.pick((("runs", "miles"), ("swims", "laps"), ("bikes", "miles"), ("walks", "miles")))
    m, days, w = d.n(1, 12), d.n(2, 7), d.n(2, 12)
    q = (f"{p.name} {sport[0]} {m} {sport[1]} a day, {days} days a week. How many {sport[1]} "
         f"does {p.he} cover in {w} weeks?")
    x, e = d.op(m, "*", days)
    d.say(f"Each week {p.he} covers {e} {sport[1]}.")
    t, e = d.op(x, "*", w)
    d.say(f"In {w} weeks {p.name} covers {e} {sport[1]}.")
    return q, t


def ticket_change(d: Draw) -> tuple[str, int]:
    p = d.person()
    event = d.pick(("the zoo", "the museum", "a movie", "a concert", "the aquarium", "a show"))
    a, c, na, nc = d.n(8, 30), d.n(3, 15), d.n(1, 4), d.n(1, 6)
    cost = calc(a, "*", na) + calc(c, "*", nc)
    pay = d.pick((100, 150, 200, 250, 300))
    if pay < cost:
        raise Reject
    q = (f"Tickets to {event} cost ${a} for an adult and ${c} for a child. {p.name} buys {na} "
         f"adult tickets and {nc} child tickets. {p.He} pays with ${pay}. How much change does "
         f"{p.he} get?")
    x, e = d.op(na, "*", a, money=True)
    d.say(f"The adult tickets cost {e}.")
    y, e = d.op(nc, "*", c, money=True)
    d.say(f"The child tickets cost {e}.")
    t, e = d.op(x, "+", y, money=True)
    d.say(f"All the tickets cost {e}.")
    r, e = d.op(pay, "-", t, money=True)
    d.say(f"{p.He} gets {e} in change.", f"So {p.name} gets {e} back.")
    return q, r


def give_then_bag(d: Draw) -> tuple[str, int]:
    p, o, (c1, cs), (_, items) = d.person(), d.person(), d.pick(CONTAINERS), d.item()
    k, each, give = d.n(2, 9), d.n(2, 30), d.n(1, 40)
    a = calc(k, "*", each) + give
    q = (f"{p.name} picks {a} {items}. {p.He} gives {give} to {o.name} and puts the rest into "
         f"{k} {cs} with the same number in each {c1}. How many {items} are in each {c1}?")
    r, e = d.op(a, "-", give)
    d.say(f"{p.name} has {e} {items} left.")
    x, e = d.op(r, "/", k)
    d.say(f"Each {c1} has {e} {items}.")
    return q, x


def fence(d: Draw) -> tuple[str, int]:
    p = d.person()
    what = d.pick(("garden", "yard", "pool", "playground", "pen"))
    length, width = d.n(5, 60), d.n(3, 39)
    q = (f"A rectangular {what} is {length} feet long and {width} feet wide. {p.name} puts a "
         f"fence around it. How many feet of fence does {p.he} need?")
    s, e = d.op(length, "+", width)
    d.say(f"One long side and one short side make {e} feet.")
    t, e = d.op(s, "*", 2)
    d.say(f"{p.name} needs {e} feet of fence.")
    return q, t


def three_days_reading(d: Draw) -> tuple[str, int]:
    p = d.person()
    a, b, c = d.n(5, 90), d.n(5, 90), d.n(5, 90)
    total = a + b + c + d.n(1, 300)
    q = (f"{p.name}'s book has {total} pages. {p.He} reads {a} pages on Monday, {b} pages on "
         f"Tuesday and {c} pages on Wednesday. How many pages are left?")
    s, e = d.sum3(a, b, c)
    d.say(f"{p.name} reads {e} pages.")
    r, e = d.op(total, "-", s)
    d.say(f"There are {e} pages left.")
    return q, r


def pizza_slices(d: Draw) -> tuple[str, int]:
    p = d.person()
    n, s, k, e_ = d.n(2, 9), d.pick((6, 8, 10, 12)), d.n(2, 9), d.n(1, 4)
    q = (f"{p.name} orders {n} pizzas and each pizza is cut into {s} slices. {k} people eat "
         f"{e_} slices each. How many slices are left?")
    t, e = d.op(n, "*", s)
    d.say(f"There are {e} slices.")
    u, e = d.op(k, "*", e_)
    d.say(f"The people eat {e} slices.")
    r, e = d.op(t, "-", u)
    d.say(f"There are {e} slices left.")
    return q, r


def pay_with_bonus(d: Draw) -> tuple[str, int]:
    p = d.person()
    w, days, bonus = d.n(10, 90), d.n(2, 7), d.n(5, 100)
    q = (f"{p.name} earns ${w} a day. {p.He} works {days} days this week and gets a bonus of "
         f"${bonus}. How much does {p.he} earn this week?")
    x, e = d.op(w, "*", days, money=True)
    d.say(f"{p.name} earns {e} for the days.")
    t, e = d.op(x, "+", bonus, money=True)
    d.say(f"With the bonus {p.he} earns {e}.")
    return q, t


def lose_and_find(d: Draw) -> tuple[str, int]:
    p, (_, items) = d.person(), d.item()
    a, lose, find = d.n(10, 500), d.n(1, 60), d.n(1, 60)
    q = (f"{p.name} has {a} {items}. {p.He} loses {lose} of them and then finds {find} more. "
         f"How many {items} does {p.he} have now?")
    x, e = d.op(a, "-", lose)
    d.say(f"After losing some, {p.he} has {e} {items}.")
    t, e = d.op(x, "+", find)
    d.say(f"Now {p.name} has {e} {items}.")
    return q, t


def team_split(d: Draw) -> tuple[str, int]:
    k, per, coaches = d.n(2, 9), d.n(4, 15), d.n(1, 9)
    sport = d.pick(("soccer", "basketball", "hockey", "volleyball", "chess", "relay"))
    q = (f"A {sport} club has {k} teams with {per} players on each team. There are also "
         f"{coaches} coaches. The club rents buses that hold {d.pick((5, 6, 8, 10, 12))} people "
         f"each. How many people are in the club?")
    x, e = d.op(k, "*", per)
    d.say(f"There are {e} players.")
    t, e = d.op(x, "+", coaches)
    d.say(f"With the coaches there are {e} people in the club.")
    return q, t


def eggs_sold(d: Draw) -> tuple[str, int]:
    p = d.person()
    hens, eggs = d.n(2, 12), d.n(1, 2)
    sold_price = d.n(1, 5)
    per_day = calc(hens, "*", eggs)
    eat = d.n(1, per_day - 1)
    q = (f"{p.name} has {hens} hens that each lay {eggs} eggs a day. {p.He} eats {eat} eggs a "
         f"day and sells the rest for ${sold_price} each. How much money does {p.he} make a day?")
    x, e = d.op(hens, "*", eggs)
    d.say(f"The hens lay {e} eggs a day.")
    r, e = d.op(x, "-", eat)
    d.say(f"{p.name} sells {e} eggs.")
    m, e = d.op(r, "*", sold_price, money=True)
    d.say(f"{p.He} makes {e} a day.")
    return q, m


TEMPLATES: tuple[Template, ...] = (
    packs_plus_owned, times_as_many, half_as_many, hourly_pay, change_left, share_equally,
    garden_rows, pages_left, weekly_savings, classroom, two_purchases, baking, road_trip, ages,
    three_collectors, filled_containers, price_difference, farm_legs, running_weeks,
    ticket_change, give_then_bag, fence, three_days_reading, pizza_slices, pay_with_bonus,
    lose_and_find, team_split, eggs_sold,
)
